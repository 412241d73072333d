"""A served engine (prediction mode): each step is accounted at its own update, requests in runs
of one-token decode steps in closed form (`decode_runs.py`), the rest explicitly; only the
outputs that finish a request, and every output of a request with stop strings, carry a row.
Those outputs leave in the same batch as without the plugin and carry what a dense engine
predicting every step whole through the ONNX step graph puts on them (to 1e-9), on played
workloads with chunked prefill, prefix-cache hits, preemption and recompute, speculative
tokens, aborts and stop strings; every joule is counted once; a request aborted from outside
counts as aborted."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_piep.model.devices import GPU_SPECS, DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.decode_runs import AUDIT_EVERY
from vllm_piep.runtime.record import ROW_DTYPE

pytest.importorskip("vllm")

from support.engine_loop import PlayedEngine, Rich, Workload  # noqa: E402

SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=4)


def _play(seed: int, n: int, steps: int, async_scheduling: bool, abort_p: float, stop_p: float,
          served: bool, finish_p: float = 0.08, rich: Rich | None = None,
          predictor: object | None = None) -> tuple[PlayedEngine, EngineAccountant]:
    """A played engine: `served` (sparse, the split rule and its closed form) or the reference
    (every output a row, every step predicted whole by the step graph)."""
    prior = predictor or PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior, split_rule=served)
    acc.sparse = served
    work = Workload(n, seed, finish_p=finish_p, abort_p=abort_p, stop_p=stop_p, rich=rich)
    engine = PlayedEngine(acc, work, True, step_ns=2_000_000)
    engine.run(steps, async_scheduling, lambda: time.sleep(0.0003))
    engine.close()
    with acc.lock:
        for req_id in list(work.live):  # the client leaves the requests still running
            acc.release(req_id)
    return engine, acc


def _carried(engine: PlayedEngine) -> dict[str, bytes]:
    """Each request's last row an output carried."""
    return {key[0]: row for key, (_, row) in engine.sent().items() if row is not None}


def _joules(row: bytes) -> float:
    r = np.frombuffer(row, ROW_DTYPE)[0]
    return float(r["prefill"] + r["decode"])


@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), n=st.integers(1, 24), async_scheduling=st.booleans(),
       abort_p=st.sampled_from([0.0, 0.05]), stop_p=st.sampled_from([0.0, 0.3]),
       rich=st.sampled_from([None, Rich(), Rich(spec_p=0.0, preempt_p=0.0)]),
       finish_p=st.sampled_from([0.02, 0.08]), gpu=st.booleans())
def test_served_outputs_leave_at_once_with_the_reference_rows_and_every_joule_once(
        seed: int, n: int, async_scheduling: bool, abort_p: float, stop_p: float,
        rich: Rich | None, finish_p: float, gpu: bool) -> None:
    steps = 60
    # A GPU's prior adds busy power to every step (`stepgraph.BusyPower`).
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], 4)
                           ) if gpu else None
    dense, dense_acc = _play(seed, n, steps, async_scheduling, abort_p, stop_p, False,
                             finish_p, rich, prior)
    sparse, sparse_acc = _play(seed, n, steps, async_scheduling, abort_p, stop_p, True,
                               finish_p, rich, prior)
    with_stop = sparse.work.with_stop
    assert len(dense.batches) == steps
    dense_out, sparse_out = dense.sent(), sparse.sent()
    assert sparse_out.keys() == dense_out.keys()  # every output goes out, once
    finishing = {out.request_id for outs in dense.batches for out in outs
                 if out.finish_reason is not None}
    for key, (b, row) in sparse_out.items():
        req_id = key[0]
        last = (req_id, key[1] + 1) not in dense_out
        wanted = (last and req_id in finishing) or req_id in with_stop
        assert (row is not None) == wanted, key
        assert b == dense_out[key][0], key  # in the same batch: nothing waits
        if wanted:  # the dense engine's row on the same output
            np.testing.assert_allclose(np.frombuffer(row, np.float64),
                                       np.frombuffer(dense_out[key][1], np.float64),
                                       rtol=1e-9, atol=1e-12 * dense_acc.total_joules)
    on, off = dense_acc.counts(), sparse_acc.counts()
    assert off.step_joules == pytest.approx(on.step_joules, rel=1e-9, abs=1e-12)
    assert off.warmup_joules == pytest.approx(on.warmup_joules, rel=1e-9, abs=1e-12)
    assert off.after_finish_joules == pytest.approx(on.after_finish_joules, rel=1e-9,
                                                    abs=1e-12)
    assert dense_acc.aborted_joules == 0.0
    assert sparse_acc.tracked_requests == dense_acc.tracked_requests == 0
    assert sparse_acc.errors == dense_acc.errors == 0 and sparse_acc.audit_failures == 0
    for engine, acc in ((dense, dense_acc), (sparse, sparse_acc)):
        counted = (sum(map(_joules, _carried(engine).values())) + acc.unsent_joules
                   + acc.aborted_joules + acc.after_finish_joules + acc.warmup_joules)
        assert counted == pytest.approx(acc.total_joules, rel=1e-9, abs=1e-12)
    # What the dense engine's outputs carried of the requests that did not finish, the sparse
    # one counts as aborted (and both count the rest as unsent).
    left = sum(_joules(row) for r, row in _carried(dense).items()
               if r not in finishing | with_stop)
    assert sparse_acc.aborted_joules + sparse_acc.unsent_joules == pytest.approx(
        dense_acc.unsent_joules + left, rel=1e-9, abs=1e-12)


def test_a_decode_run_costs_the_engine_o1_per_step_and_its_total_is_the_references() -> None:
    """Plain decode steps (no finishes, no aborts): after the first steps every step is regular
    (its requests go on in their runs, none split explicitly), every regular step's audit
    agrees, and the totals the client's aborts take at the end are the reference's."""
    steps = 768
    sparse, acc = _play(3, 8, steps, False, 0.0, 0.0, True, finish_p=0.0)
    _, ref = _play(3, 8, steps, False, 0.0, 0.0, False, finish_p=0.0)
    assert acc.regular_steps >= steps - 16 - 3 * 2
    assert acc.audits >= acc.regular_steps and acc.audit_failures == 0
    assert acc.total_joules == pytest.approx(ref.total_joules, rel=1e-9)
    assert acc.aborted_joules + acc.warmup_joules == pytest.approx(acc.total_joules, rel=1e-9)
    with_header = [b for b, outs in enumerate(sparse.batches)
                   if outs[0].kv_transfer_params is not None]
    assert all(sparse.rows[b] == b"" for b in with_header)  # no row: the counts only


def test_an_audit_that_disagrees_ends_the_closed_form_and_is_counted(caplog) -> None:
    """A member whose context the cheap checks cannot see move (one request two tokens on,
    another none: the sums agree) is caught by the next audit: counted, said once, and every
    step is split explicitly from then on."""
    from vllm_piep.runtime.engine_core.scheduled import RawStep

    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior)
    acc.sparse = True
    ids, context = ["a", "b"], [100, 200]
    steps = 512
    for key in range(steps):
        start = list(context)
        if key == steps // 4:
            start = [context[0] + 1, context[1] - 1]  # what the checks cannot see
        new = {r: 32 for r in ids} if key == 0 else {}
        acc.on_schedule(key, RawStep(ids, (start, []), ([c - 31 for c in start], []),
                                     {r: 1 for r in ids}, {}, new), at_ns=key * 10)
        acc.on_step_done(key, worker_step_ns=1_000_000, at_ns=key * 10 + 5)
        context = [c + 1 for c in start]
    assert acc.audit_failures == 1 and acc.runs is None
    assert sum("a check one by one disagrees" in r.message for r in caplog.records) == 1
    assert acc.errors == 0 and acc.steps == steps
    assert acc.regular_steps < steps // 4 + AUDIT_EVERY  # caught by the next audit


def test_a_late_step_of_a_released_request_counts_as_unsent() -> None:
    """Async scheduling: a request aborted while a step naming it is in flight: the step's
    share of it is unsent energy, as the reference counts it, and the step stays regular for
    the others."""
    from vllm_piep.runtime.engine_core.scheduled import RawStep

    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    served, ref = EngineAccountant(lambda: prior), EngineAccountant(lambda: prior,
                                                                     split_rule=False)
    late = []
    for acc in (served, ref):
        acc.sparse = acc is served
        ids = ["a", "b", "c"]
        for key in range(13):  # the warm-up rule is ready after these
            start = [40 + key] * 3
            acc.on_schedule(key, RawStep(ids, (start, []), ([9 + key] * 3, []),
                                         {r: 1 for r in ids}, {},
                                         {r: 32 for r in ids} if key == 0 else {}),
                            at_ns=key * 10)
            acc.on_step_done(key, worker_step_ns=1_000_000, at_ns=key * 10 + 5)
        regular = getattr(acc, "regular_steps", 0)
        acc.on_schedule(99, RawStep(ids, ([53] * 3, []), ([22] * 3, []), {r: 1 for r in ids},
                                    {}, {}), at_ns=200)
        acc.release("a")  # aborted, its step in flight
        assert "a" not in acc.table.slots
        before = acc.unsent_joules
        acc.on_step_done(99, worker_step_ns=1_000_000, at_ns=205)
        late.append(acc.unsent_joules - before)  # the late step's share of "a"
        if acc is served:
            assert acc.regular_steps == regular + 1  # b and c went on in their runs
    assert late[0] > 0.0 and late[0] == pytest.approx(late[1], rel=1e-9)
    assert "a" not in served.table.slots and served.tracked_requests == 2
    assert served.total_joules == pytest.approx(ref.total_joules, rel=1e-9)
    for r in ("b", "c"):
        assert served.record(r).joules == pytest.approx(ref.record(r).joules, rel=1e-9)


def test_the_served_accounting_calls_no_numpy() -> None:
    """Once the predictor is loaded, no step, finishing output or release of a served engine
    calls into numpy (its cost per call exceeds a step's arithmetic): every call made while the
    accountant runs the engine loop's queued work, on a rich workload with stop strings,
    aborts and warm-up, is recorded and none is numpy's."""
    import sys

    from vllm_piep.runtime.engine_core.deferred import DeferredCalls

    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], 4))
    acc = EngineAccountant(lambda: prior)
    acc.sparse = True
    assert acc.predictor is prior  # loading it (and checking its Python split) uses numpy
    seen: list[str] = []
    runs = 0

    def profiler(frame, event, arg) -> None:  # noqa: ANN001
        if event == "call" and "/numpy/" in frame.f_code.co_filename:
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            module = getattr(arg, "__module__", None) or type(owner).__module__
            if module and module.startswith("numpy"):
                seen.append(repr(arg))

    class Watched(DeferredCalls):
        def run(self) -> int:
            nonlocal runs
            runs += 1
            sys.setprofile(profiler)
            try:
                return super().run()
            finally:
                sys.setprofile(None)

    acc.deferred = Watched(acc._deferred_failed)
    work = Workload(12, 5, finish_p=0.08, abort_p=0.05, stop_p=0.3, rich=Rich())
    engine = PlayedEngine(acc, work, True, step_ns=2_000_000)
    engine.run(120, True, lambda: time.sleep(0.0003))
    engine.close()
    assert runs > 100 and acc.regular_steps > 0 and acc.errors == 0
    assert not seen, seen[:10]
