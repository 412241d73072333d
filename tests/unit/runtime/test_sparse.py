"""A sparse engine (prediction mode, as served): only the outputs that finish a request, and
every output of a request with stop strings, carry a row, and steps are evaluated when a row or
a count is read, several in one call. Those outputs carry what a dense engine puts on the same
outputs (to 1e-9: the steps evaluated together are summed in another order), every joule is
counted once, and a request aborted from outside counts as aborted."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_piep.model.devices import DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.runtime.engine_core.accounting import MAX_UNEVALUATED, EngineAccountant
from vllm_piep.runtime.record import ROW_BYTES, ROW_DTYPE

pytest.importorskip("vllm")

from support.engine_loop import PlayedEngine, Workload  # noqa: E402

SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=4)


def _play(seed: int, n: int, steps: int, async_scheduling: bool, abort_p: float, stop_p: float,
          sparse: bool, finish_p: float = 0.08) -> tuple[PlayedEngine, EngineAccountant]:
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior)
    acc.sparse = sparse
    work = Workload(n, seed, finish_p=finish_p, abort_p=abort_p, stop_p=stop_p)
    engine = PlayedEngine(acc, work, True, step_ns=2_000_000)
    engine.run(steps, async_scheduling, lambda: time.sleep(0.0003))
    engine.close()
    with acc.lock:
        for req_id in list(work.live):  # the client leaves the requests still running
            acc.release(req_id)
    return engine, acc


def _carried(engine: PlayedEngine) -> dict[str, bytes]:
    """Each request's last row an output carried."""
    last: dict[str, bytes] = {}
    for b, outs in enumerate(engine.batches):
        block = engine.rows[b]
        for k, i in enumerate(engine.picked(b)):
            last[outs[i].request_id] = block[k * ROW_BYTES:(k + 1) * ROW_BYTES]
    return last


def _joules(row: bytes) -> float:
    r = np.frombuffer(row, ROW_DTYPE)[0]
    return float(r["prefill"] + r["decode"])


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), n=st.integers(1, 24), async_scheduling=st.booleans(),
       abort_p=st.sampled_from([0.0, 0.05]), stop_p=st.sampled_from([0.0, 0.3]))
def test_sparse_outputs_carry_the_dense_rows_and_every_joule_is_counted_once(
        seed: int, n: int, async_scheduling: bool, abort_p: float, stop_p: float) -> None:
    steps = 40
    dense, dense_acc = _play(seed, n, steps, async_scheduling, abort_p, stop_p, False)
    sparse, sparse_acc = _play(seed, n, steps, async_scheduling, abort_p, stop_p, True)
    with_stop = sparse.work.with_stop
    assert len(sparse.batches) == len(dense.batches) == steps
    for b, outs in enumerate(sparse.batches):
        wanted = [i for i, out in enumerate(outs)
                  if out.finish_reason is not None or out.request_id in with_stop]
        assert sparse.picked(b) == wanted
        rows = [dense.rows[b][i * ROW_BYTES:(i + 1) * ROW_BYTES] for i in wanted]
        assert len(sparse.rows[b]) == len(rows) * ROW_BYTES
        np.testing.assert_allclose(np.frombuffer(sparse.rows[b], np.float64),
                                   np.frombuffer(b"".join(rows), np.float64),
                                   rtol=1e-9, atol=1e-15)
    on, off = dense_acc.counts(), sparse_acc.counts()
    assert off.step_joules == pytest.approx(on.step_joules, rel=1e-9, abs=1e-12)
    assert off.warmup_joules == pytest.approx(on.warmup_joules, rel=1e-9, abs=1e-12)
    assert off.after_finish_joules == pytest.approx(on.after_finish_joules, rel=1e-9,
                                                    abs=1e-12)
    assert dense_acc.aborted_joules == 0.0
    assert sparse_acc.tracked_requests == dense_acc.tracked_requests == 0
    for engine, acc in ((dense, dense_acc), (sparse, sparse_acc)):
        counted = (sum(map(_joules, _carried(engine).values())) + acc.unsent_joules
                   + acc.aborted_joules + acc.after_finish_joules + acc.warmup_joules)
        assert counted == pytest.approx(acc.total_joules, rel=1e-9, abs=1e-12)
    # What the dense engine's outputs carried of the requests that did not finish, the sparse
    # one counts as aborted (and both count the rest as unsent).
    finished = {out.request_id for outs in dense.batches for out in outs
                if out.finish_reason is not None} | with_stop
    left = sum(_joules(row) for r, row in _carried(dense).items() if r not in finished)
    assert sparse_acc.aborted_joules + sparse_acc.unsent_joules == pytest.approx(
        dense_acc.unsent_joules + left, rel=1e-9, abs=1e-12)


def test_steps_wait_for_evaluation_at_most_max_unevaluated() -> None:
    """No finishes, no aborts: the sparse engine evaluates every MAX_UNEVALUATED steps, and a
    batch carries the header (new counts) then only."""
    steps = 3 * MAX_UNEVALUATED
    sparse, acc = _play(3, 8, steps, False, 0.0, 0.0, True, finish_p=0.0)
    assert acc.aborted_joules > 0 and acc.unsent_joules == 0.0  # the requests left at the end
    with_header = [b for b, outs in enumerate(sparse.batches)
                   if outs[0].kv_transfer_params is not None]
    assert 2 <= len(with_header) <= steps // MAX_UNEVALUATED
    assert all(sparse.rows[b] == b"" for b in with_header)


def test_a_request_aborted_before_its_steps_were_evaluated_counts_them_as_aborted() -> None:
    from vllm_piep.runtime.engine_core.accounting import ScheduledStep

    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    eager, acc = EngineAccountant(lambda: prior), EngineAccountant(lambda: prior)
    acc.sparse = True
    sched = np.array([[0.0, 40.0], [16.0, 1.0], [0.0, 8.0], [1.0, 1.0]])
    for a in (eager, acc):
        for key in range(3):
            a.on_schedule(key, ScheduledStep(["a", "b"], sched, {"a": 16, "b": 32} if key == 0
                                             else {}), at_ns=key)
            a.on_step_done(key, worker_step_ns=1_000_000, at_ns=key + 1)
    assert acc.total_joules == 0.0 and acc.steps == 0  # nothing read yet: nothing evaluated
    a_share = eager.record("a").joules
    acc.release("a")
    assert acc.steps == 3 and acc.total_joules == pytest.approx(eager.total_joules, rel=1e-12)
    assert acc.aborted_joules == pytest.approx(a_share, rel=1e-12) and a_share > 0
    assert acc.unsent_joules == 0.0 and acc.tracked_requests == 1
    assert acc.record("b") == eager.record("b")


def test_the_steps_waiting_go_to_the_predictor_in_one_call(monkeypatch) -> None:
    """Once the warm-up rule can judge steps, an evaluation predicts the steps waiting in one
    `run_many` call; the totals are a dense engine's."""
    from vllm_piep.predict.stepgraph import StepGraph
    from vllm_piep.runtime.engine_core.warmup import WarmupDetector

    calls: list[int] = []
    run_many = StepGraph.run_many

    def counted(self, sched, prompt, seconds, starts):  # type: ignore[no-untyped-def]
        calls.append(len(starts))
        return run_many(self, sched, prompt, seconds, starts)

    monkeypatch.setattr(StepGraph, "run_many", counted)
    steps = 4 * MAX_UNEVALUATED
    _, acc = _play(5, 8, steps, False, 0.0, 0.0, True, finish_p=0.0)
    _, dense_acc = _play(5, 8, steps, False, 0.0, 0.0, False, finish_p=0.0)
    alone = WarmupDetector().min_history  # judged one by one until the rule is ready
    assert acc.steps == dense_acc.steps == steps
    assert sum(calls) == steps - alone and max(calls) == MAX_UNEVALUATED
    assert acc.total_joules == pytest.approx(dense_acc.total_joules, rel=1e-9)
    # No output finished a request: the client's aborts at the end took every joule.
    assert acc.aborted_joules + acc.warmup_joules == pytest.approx(acc.total_joules, rel=1e-9)


def test_steps_are_predicted_one_by_one_when_the_call_for_several_fails(monkeypatch) -> None:
    from vllm_piep.predict.stepgraph import StepGraph

    def broken(self, sched, prompt, seconds, starts):  # type: ignore[no-untyped-def]
        raise MemoryError("no room for the steps side by side")

    monkeypatch.setattr(StepGraph, "run_many", broken)
    steps = 3 * MAX_UNEVALUATED
    _, acc = _play(7, 8, steps, True, 0.0, 0.0, True, finish_p=0.0)
    _, dense_acc = _play(7, 8, steps, True, 0.0, 0.0, False, finish_p=0.0)
    assert acc.steps == steps and acc.errors == 0
    assert acc.total_joules == pytest.approx(dense_acc.total_joules, rel=1e-9)
