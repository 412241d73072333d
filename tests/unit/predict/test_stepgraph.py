"""Property tests of the serve path's step graph: what each request computes, the split of the
step's energy, and the engine's running totals, on random scheduler states (chunked prefill,
prefix-cache hits, preemption and recompute, speculative tokens, aborts), for the analytic
prior and the shipped calibrated bundle alike."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.paths import SHIPPED_BUNDLE

from vllm_piep.model.components import COMPONENTS, STATIC
from vllm_piep.model.devices import GPU_SPECS, DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape, StepBatch, step_work
from vllm_piep.predict.bundle import TreeBundle
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.predict.served import BundlePredictor, reference_step_joules
from vllm_piep.predict.stepgraph import raw_inputs
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.scheduled import ScheduledStep, step_batch
from vllm_piep.runtime.record import ROW_BYTES, WireRecord

BUNDLE = SHIPPED_BUNDLE
SERVING = json.loads((BUNDLE / "manifest.json").read_text())["serving"]
SHAPE = ModelShape(**{f.name: SERVING["shape"][f.name] for f in dataclasses.fields(ModelShape)
                      if f.name in SERVING["shape"]})
PROFILE = DeviceProfile.from_spec(cpu_spec(), SHAPE.dtype_bytes)


MOE = dataclasses.replace(SHAPE, experts=8, top_k=2, expert_intermediate=SHAPE.intermediate // 2,
                          moe_layers=SHAPE.layers)


# A fitted GPU's prior: its steps carry busy power (`stepgraph.BusyPower`).
H100 = DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], SHAPE.dtype_bytes)


@pytest.fixture(scope="module")
def predictors() -> dict[str, object]:
    return {"prior": PriorPredictor(SHAPE, PROFILE),
            "bundle": BundlePredictor(TreeBundle.load(BUNDLE), SHAPE, PROFILE),
            "moe prior": PriorPredictor(MOE, PROFILE),
            "gpu prior": PriorPredictor(dataclasses.replace(SHAPE, tp=2), H100),
            "gpu moe prior": PriorPredictor(MOE, H100),
            # a fit with no energy per byte: the experts' reads keep the GPUs busy, no more
            "gpu moe prior, no byte energy": PriorPredictor(MOE, dataclasses.replace(
                H100, joules_per_byte=0.0, joules_per_flop=1e-12))}


@st.composite
def scheduler_states(draw: st.DrawFn, max_requests: int = 96) -> tuple[np.ndarray, np.ndarray]:
    """(`sched` [4, N], `prompt` [1, N]) as vLLM's scheduler holds them: a request has a prompt
    and some outputs; `start` tokens are in the KV cache (computed, or a prefix-cache hit; 0
    again after preemption); `n` are scheduled now, up to the known tokens plus speculation."""
    n_req = draw(st.integers(1, max_requests))
    cols = []
    for _ in range(n_req):
        prompt = draw(st.integers(1, 4096))
        outs = draw(st.integers(0, 256))
        known = prompt + outs
        kind = draw(st.sampled_from(["decode", "chunk", "cached", "recompute", "spec"]))
        if kind == "decode":
            start, n, spec = known - 1, 1, 0
        elif kind == "spec":
            spec = draw(st.integers(1, 4))
            start, n = known - 1, 1 + spec
        elif kind == "recompute":  # preempted, everything computed again
            start, n, spec = 0, draw(st.integers(1, known)), 0
        else:  # a prefill chunk, after a prefix-cache hit of `start` tokens when "cached"
            outs = 0
            start = draw(st.integers(1, prompt - 1)) if kind == "cached" and prompt > 1 else 0
            n, spec = draw(st.integers(1, prompt - start)), 0
        cols.append((start, n, outs, 1 + spec, prompt))
    a = np.array(cols, dtype=np.float64).T
    return a[:4].copy(), a[4:5].copy()


seconds = st.floats(0.0, 0.5, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(state=scheduler_states(), secs=seconds,
       which=st.sampled_from(["prior", "bundle", "gpu prior"]))
def test_split_conserves_the_step_energy(predictors, state, secs, which) -> None:
    sched, prompt = state
    requests, joules = predictors[which].run_step(sched, prompt, secs)
    comps = requests[2:]
    assert (requests >= 0).all() and np.isfinite(requests).all()
    # Every component's column adds up to the step's energy for it, and so does the total.
    np.testing.assert_allclose(comps.sum(axis=1), joules, rtol=1e-9, atol=1e-300)
    assert comps.sum() == pytest.approx(joules.sum(), rel=1e-9)
    # Each request's prefill and decode make up its energy.
    np.testing.assert_allclose(requests[0] + requests[1], comps.sum(axis=0), rtol=1e-9)
    # Static energy by time share: every request held the devices for the whole step.
    n = sched.shape[1]
    np.testing.assert_allclose(comps[STATIC], joules[STATIC] / n, rtol=1e-9)


@settings(max_examples=100, deadline=None)
@given(state=scheduler_states(), which=st.sampled_from(["prior", "bundle"]))
def test_work_in_the_graph_is_what_the_scheduler_ran(predictors, state, which) -> None:
    """The graph's per-request work equals the numpy formulas on the same batch: prompt tokens
    only where the step computes them (cached prefix tokens cost no prefill), context for
    attention, logits only where the step samples."""
    sched, prompt = state
    batch = step_batch(sched, prompt[0])
    start, n, outs, draws = sched
    assert (batch.prefill_tokens == np.clip(np.minimum(start + n, prompt[0]) - start, 0, None)
            ).all()
    assert (batch.prefill_tokens + batch.decode_tokens == n).all()
    requests, _ = predictors[which].run_step(sched, prompt, 0.0)
    no_prompt = batch.prefill_tokens == 0
    assert (requests[0][no_prompt] == 0).all()  # no prefill energy without prompt tokens
    if which == "prior":  # its split is its own product: check it against the formulas
        work = step_work(SHAPE, batch)
        co = PROFILE
        expected = (co.joules_per_flop * work.flops + co.joules_per_byte * work.mem_bytes
                    + co.joules_per_link_byte * work.link_bytes)
        dynamic = [i for i in range(len(COMPONENTS)) if i != STATIC]
        np.testing.assert_allclose(requests[2:][dynamic].T, expected[:, dynamic], rtol=1e-9,
                                   atol=1e-18)


@settings(max_examples=60, deadline=None)
@given(state=scheduler_states(max_requests=16), secs=seconds)
def test_bundle_graph_equals_the_reference_evaluation(predictors, state, secs) -> None:
    """The folded leaves give the bundle's own reference evaluation of the step (its ONNX
    leaves through `TreeBundle.predict`)."""
    from vllm_piep.model.flops import StepTotals

    sched, prompt = state
    bundle = predictors["bundle"]
    _, joules = bundle.run_step(sched, prompt, secs)
    batch = step_batch(sched, prompt[0])
    want = reference_step_joules(bundle.bundle, SHAPE, StepTotals.of(batch), len(batch), secs)
    assert joules.sum() == pytest.approx(want, rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(state=scheduler_states(), secs=st.one_of(seconds, st.just(float("nan")), st.just(-1.0)),
       which=st.sampled_from(["prior", "bundle", "moe prior", "gpu prior", "gpu moe prior",
                                   "gpu moe prior, no byte energy"]))
# One token's dynamic energy, 1e-12 of the step's static energy: busy power is spread in
# proportion to it, so it must not be found as a difference with the static energy.
@example(state=(np.array([[0.0], [1.0], [0.0], [1.0]]), np.array([[1.0]])), secs=0.5,
         which="gpu moe prior, no byte energy")
def test_the_split_rule_is_the_graphs(predictors, state, secs, which) -> None:
    """The split rule in numpy (`split_rule.py`, what the engine runs and the docs cite) gives
    every request what the ONNX step graph gives it, to rounding, and its per-feature
    coefficients applied to a one-token decode's features are its decode terms."""
    from vllm_piep.predict.split_rule import DECODE_U, DECODE_V, SplitRule, decode_terms

    graph = predictors[which].graph
    assert (graph.spec.expert_read[1] > 0) == ("moe" in which and "no byte" not in which)
    assert (graph.spec.busy is not None) == ("gpu" in which)
    sched, prompt = state
    rule = SplitRule(graph.spec)
    requests, joules = rule.split(sched, prompt[0], secs)
    want, want_j = graph.run(sched, prompt, secs)
    scale = np.abs(want).max() + 1e-300
    np.testing.assert_allclose(requests, want, rtol=1e-9, atol=1e-12 * scale)
    np.testing.assert_allclose(joules, want_j, rtol=1e-9, atol=1e-300)
    per_feature = rule.coefficients(rule_sums(sched, prompt[0]), secs).per_feature
    at_zero, per_token = decode_terms(per_feature).T
    context = 1234.0
    np.testing.assert_allclose(at_zero + context * per_token,
                               per_feature @ (DECODE_U + context * DECODE_V), rtol=1e-12)
    # A step of one-token decodes alone, folded (`SplitRule.decode_step`), is the same split.
    d, e = int(sched.shape[1]), float(sched[0].sum()) + 1.0
    folded = rule.decode_step(d, e, secs)
    assert folded is not None
    whole = rule.coefficients(d * DECODE_U + e * DECODE_V, secs)
    np.testing.assert_allclose(folded[1], whole.joules, rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(folded[0], decode_terms(whole.per_feature), rtol=1e-9,
                               atol=1e-300)


@settings(max_examples=150, deadline=None)
@given(state=scheduler_states(), secs=st.one_of(seconds, st.just(float("nan")), st.just(-1.0)),
       which=st.sampled_from(["prior", "bundle", "moe prior", "gpu prior", "gpu moe prior",
                                   "gpu moe prior, no byte energy"]),
       runs=st.tuples(st.integers(0, 300), st.integers(0, 10_000)),
       keep=st.one_of(st.just(1.0), st.floats(0.0, 1.0)))
def test_the_python_split_is_the_split_rule(predictors, state, secs, which, runs, keep) -> None:
    """The split rule written out as Python for the predictor (`split_code.py`, what the engine
    runs) gives every explicit request, the runs' decode terms and the step's joules what the
    numpy reference gives (`runs`: requests in runs of one-token decodes and their contexts'
    sum; `keep`: the static part warm-up leaves)."""
    from vllm_piep.predict.split_code import PythonSplit, base
    from vllm_piep.predict.split_rule import DECODE_U, DECODE_V, SplitRule, decode_terms

    rule = SplitRule(predictors[which].graph.spec)
    split = PythonSplit(rule)
    sched, prompt = state
    d, e = runs[0], float(runs[1] * runs[0])
    bases = [base(*col) for col in zip(*sched.tolist(), prompt[0].tolist(), strict=True)]
    shares, terms, joules, total, static = split.explicit(bases, [], d, e, secs, keep)
    ref = rule.coefficients(rule_sums(sched, prompt[0]) + d * DECODE_U + e * DECODE_V, secs)
    per_feature = ref.per_feature.copy()
    per_feature[STATIC] *= keep
    live = list(split.live)
    scale = float(np.abs(ref.joules).sum()) + 1e-300
    np.testing.assert_allclose(joules, ref.joules[live], rtol=1e-9, atol=1e-12 * scale)
    assert total == pytest.approx(ref.joules.sum(), rel=1e-9, abs=1e-300)
    assert static == pytest.approx(ref.joules[STATIC], rel=1e-9, abs=1e-300)
    assert not np.delete(ref.joules, live).any()  # the components left out have no energy
    want_terms = decode_terms(per_feature)[live]
    np.testing.assert_allclose(terms, [*want_terms[:, 0], *want_terms[:, 1]], rtol=1e-9,
                               atol=1e-12 * (np.abs(want_terms).max() + 1e-300))
    from vllm_piep.predict.split_rule import base_features, phases

    requests = np.empty((2 + len(COMPONENTS), len(bases)))
    feats = base_features(sched, prompt[0])
    requests[2:] = per_feature @ feats
    phases(requests, feats)
    want = requests[[0, 1, *[2 + c for c in live]]].T
    np.testing.assert_allclose(shares, want, rtol=1e-9, atol=1e-12 * scale)
    if d and e > 0:  # the runs alone, folded
        folded = split.decode(d, e, secs, keep)
        alone = split.explicit([], [], d, e, secs, keep)
        np.testing.assert_allclose(folded[0], alone[1], rtol=1e-9, atol=1e-300)
        np.testing.assert_allclose(folded[1], alone[2], rtol=1e-9, atol=1e-300)
        assert folded[2] == pytest.approx(alone[3], rel=1e-9)


def test_a_python_split_that_disagrees_with_its_rule_is_not_served(predictors, monkeypatch,
                                                                    caplog) -> None:
    """Generated code that differs from the reference (here: one constant changed) is refused
    when the predictor loads, with one warning; the engine then predicts each step whole
    through the step graph, and its records are the reference's."""
    from vllm_piep.predict import split_code
    from vllm_piep.predict.split_rule import SplitRule

    prior = predictors["prior"]
    real = split_code._Writer.source

    def wrong(self) -> str:
        return real(self).replace(" * keep", " * keep * 0.5", 1)  # static shares halved
    monkeypatch.setattr(split_code._Writer, "source", wrong)
    assert split_code.make_python_split(SplitRule(prior.graph.spec)) is None
    said = [r.message for r in caplog.records if "disagrees with its reference" in r.message]
    assert len(said) == 1 and "Error" not in said[0], said  # a difference, not a fault
    served, reference = (EngineAccountant(lambda: prior), EngineAccountant(lambda: prior,
                                                                           split_rule=False))
    for acc in (served, reference):
        assert acc.predictor is prior
        batch = StepBatch.from_rows([(30, 0, 0, 1), (0, 1, 55, 1)])
        acc.on_schedule(1, ["a", "b"], batch, at_ns=0)
        acc.on_step_done(1, worker_step_ns=2_000_000, at_ns=5)
    assert served.runs is None
    for req_id in ("a", "b"):
        assert served.record(req_id).components == pytest.approx(
            reference.record(req_id).components, rel=1e-12)


def rule_sums(sched: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    from vllm_piep.predict.split_rule import base_features

    return base_features(sched, prompt).sum(axis=1)


def test_a_prefix_cache_hit_costs_less_prefill(predictors) -> None:
    for predictor in predictors.values():
        cold = ScheduledStep.of_batch(["a"], StepBatch.from_rows([(512, 0, 0, 1)]))
        warm = np.array([[448.0], [64.0], [0.0], [1.0]]), np.array([[512.0]])  # 448 cached
        cold_j = predictor.run_step(cold.sched, cold.prompt, 0.0)[0][0, 0]
        warm_j = predictor.run_step(*warm, 0.0)[0][0, 0]
        assert 0 < warm_j < cold_j


def test_batch_and_scheduler_forms_agree(predictors) -> None:
    batch = StepBatch.from_rows([(30, 0, 0, 1), (7, 0, 9, 0), (0, 1, 55, 1), (0, 3, 12, 3)])
    sched, prompt = raw_inputs(batch)
    np.testing.assert_array_equal(step_batch(sched, prompt[0]).array, batch.array)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), which=st.sampled_from(["prior", "bundle"]))
def test_engine_totals_add_up_through_aborts(predictors, data, which) -> None:
    """Steps of random batches, outputs for some requests, aborts of others (also while their
    step runs): what outputs carried plus what no output carried (unsent) is the engine's
    predicted total, and no state is left."""
    acc = EngineAccountant(lambda: predictors[which], clock_ns=lambda: 0)
    live: list[str] = []
    carried: dict[str, float] = {}
    next_id = 0
    for key in range(data.draw(st.integers(1, 12))):
        for _ in range(data.draw(st.integers(0, 4))):
            live.append(f"r{next_id}")
            next_id += 1
        if not live:
            continue
        sched, prompt = data.draw(scheduler_states(max_requests=len(live)))
        ids = live[:sched.shape[1]]
        acc.on_schedule(key, ScheduledStep(ids, sched, {}, prompt))
        for r in ids:  # vLLM aborts requests between a step's execution and its update
            if data.draw(st.integers(0, 5)) == 0:
                acc.release(r)
                live.remove(r)
        acc.on_step_done(key, worker_step_ns=1_000_000)
        with_output = [r for r in ids if r in live and data.draw(st.booleans())]
        block = acc.encode(with_output)
        header = acc.header()
        for i, r in enumerate(with_output):
            carried[r] = WireRecord.from_wire(header, block[i * ROW_BYTES:(i + 1) * ROW_BYTES]
                                              ).joules
        for r in list(live):
            if data.draw(st.integers(0, 3)) == 0:  # finished or aborted
                acc.release(r)
                live.remove(r)
    for r in live:
        acc.release(r)
    assert acc.tracked_requests == 0
    assert sum(carried.values()) + acc.unsent_joules == pytest.approx(acc.total_joules,
                                                                     rel=1e-9, abs=1e-12)
