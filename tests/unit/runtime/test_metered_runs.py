"""Measured mode with decode runs in closed form (`metered_runs.py`): on played workloads (chunked
prefill, prefix-cache hits, preemption, speculative tokens, aborts) with a meter read every few
steps, every finished request's measured total, its predicted and unmeasured joules, and every
outcome are what an engine that splits and defers every step explicitly gets (to 1e-9);
steps + idle = the meter's delta; a finished request waits exactly while a step of it does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine_loop import Rich, Workload  # noqa: I001

from vllm_piep.meters.split import IntervalSplitter
from vllm_piep.model.devices import DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.metered_runs import MeteredRuns
from vllm_piep.runtime.engine_core.scheduled import new_requests, raw_step

SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=4)
STEP_NS = 5_000_000


def _play(served: bool, seed: int, n: int, steps: int, rich: Rich | None, read_every: int,
          fail_at: int | None, segment: int | None) -> tuple[EngineAccountant, dict, float]:
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior, clock_ns=lambda: clock[0], split_rule=served)
    acc.sparse = True
    clock = [0]
    splitter = IntervalSplitter(3.0)
    splitter.add_reading(0, 0.0)
    acc.predictor  # noqa: B018  (loaded, as the meter's start loads it)
    acc.measure_with(splitter, "standin", "measured")
    if segment is not None and isinstance(acc.runs, MeteredRuns):  # many segments
        acc.runs = acc.settler.runs = MeteredRuns(acc.table, acc.runs.columns,  # type: ignore[union-attr]
                                                  acc.settler.released, segment=segment)
    work = Workload(n, seed, finish_p=0.06, abort_p=0.02, rich=rich)
    rng = np.random.default_rng(seed)
    meter = 0.0
    records: dict[str, tuple[float, ...]] = {}
    waiting: list[str] = []

    def finish_ready() -> None:
        for req_id in [r for r in waiting if not acc.unsettled(r)]:
            waiting.remove(req_id)
            rec = acc.record(req_id)
            records[req_id] = (rec.prefill_joules, rec.decode_joules, *rec.components,
                               rec.predicted_joules,
                               rec.unmeasured_joules)
            acc.encode([req_id])
            acc.release(req_id, aborted=False)

    for k in range(steps):
        so, _, ended, aborted = work.step()
        if so.total_num_scheduled_tokens:  # as vLLM's engine, which runs no empty step
            new = new_requests(so.scheduled_new_reqs, work.requests)
            acc.on_schedule(k, raw_step(so, new), at_ns=clock[0])
            clock[0] += STEP_NS
            acc.on_step_done(k, worker_step_ns=STEP_NS, at_ns=clock[0])
        waiting.extend(ended)
        for req_id in aborted:
            acc.release(req_id)
        meter += 0.05 + 0.02 * rng.random()
        if k == fail_at:  # the meter fails once: the steps waiting are settled by the fit
            acc.settle(fallback_until_ns=acc.known_until_ns())
            splitter.add_reading(clock[0], meter + 100.0)  # re-based: that energy is a gap
            meter += 100.0
        elif k % read_every == read_every - 1:
            splitter.add_reading(clock[0], meter)
            acc.settle()
        finish_ready()
    clock[0] += STEP_NS
    splitter.add_reading(clock[0], meter + 0.01)
    acc.settle()
    finish_ready()
    assert not waiting
    for req_id in list(work.live):
        acc.release(req_id)
    return acc, records, meter + 0.01


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), n=st.integers(1, 20),
       rich=st.sampled_from([None, Rich(), Rich(spec_p=0.0, preempt_p=0.0)]),
       read_every=st.integers(1, 6), fail=st.booleans(), segment=st.sampled_from([None, 4, 16]))
def test_measured_runs_give_what_explicit_steps_give(seed: int, n: int, rich: Rich | None,
                                                     read_every: int, fail: bool,
                                                     segment: int | None) -> None:
    steps = 90
    fail_at = 40 if fail else None
    served, ours, delta = _play(True, seed, n, steps, rich, read_every, fail_at, segment)
    ref, theirs, _ = _play(False, seed, n, steps, rich, read_every, fail_at, None)
    assert served.errors == ref.errors == 0 and served.audit_failures == 0
    assert served.regular_steps > 0 or n == 1 or rich is not None
    assert ours.keys() == theirs.keys()
    scale = max(ref.total_joules, 1e-12)
    for req_id, values in ours.items():
        np.testing.assert_allclose(values, theirs[req_id], rtol=1e-9, atol=1e-12 * scale,
                                   err_msg=req_id)
    a, b = served.counts(), ref.counts()
    for field in ("step_joules", "unsent_joules", "aborted_joules", "after_finish_joules",
                  "warmup_joules", "predicted_joules", "idle_joules", "fitted_joules"):
        assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-9,
                                                  abs=1e-12 * scale), field
    assert a.fallback_steps == b.fallback_steps
    if not fail:  # a meter that failed is re-based: the energy between is not split
        assert a.step_joules + a.idle_joules == pytest.approx(delta, rel=1e-9)
    returned = sum(v[0] + v[1] for v in ours.values())
    outcomes = returned + a.unsent_joules + a.aborted_joules + a.after_finish_joules \
        + a.warmup_joules
    assert outcomes == pytest.approx(a.step_joules, rel=1e-9)
    assert served.tracked_requests == 0
