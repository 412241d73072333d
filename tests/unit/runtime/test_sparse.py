"""A sparse engine (prediction mode, as served): only the outputs that finish a request, and
every output of a request with stop strings, carry a row, and steps are evaluated when a row or
a count is read, several in one call. Those outputs carry what a dense engine puts on the same
outputs (to 1e-9: the steps evaluated together are summed in another order), every joule is
counted once, and a request aborted from outside counts as aborted."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_piep.model.devices import DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.runtime.engine_core.accountant import MAX_UNEVALUATED, EngineAccountant
from vllm_piep.runtime.record import COLUMN, ROW_DTYPE

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
    return {key[0]: row for key, (_, row) in engine.sent().items() if row is not None}


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
        if wanted:  # the dense engine's row on the same output (held or not)
            np.testing.assert_allclose(np.frombuffer(row, np.float64),
                                       np.frombuffer(dense_out[key][1], np.float64),
                                       rtol=1e-9, atol=1e-15)
            # A held output waits for the log's pass: at most MAX_UNEVALUATED steps.
            assert dense_out[key][0] <= b <= dense_out[key][0] + MAX_UNEVALUATED + 1
        else:
            assert b == dense_out[key][0]  # only finishing outputs are held
    on, off = dense_acc.counts(), sparse_acc.counts()
    assert off.step_joules == pytest.approx(on.step_joules, rel=1e-9, abs=1e-12)
    assert off.warmup_joules == pytest.approx(on.warmup_joules, rel=1e-9, abs=1e-12)
    assert off.after_finish_joules == pytest.approx(on.after_finish_joules, rel=1e-9,
                                                    abs=1e-12)
    assert dense_acc.aborted_joules == 0.0
    assert sparse_acc.tracked_requests == dense_acc.tracked_requests == 0
    assert not sparse_acc.holding
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
    from vllm_piep.runtime.engine_core.scheduled import ScheduledStep

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
    assert acc.steps == 0 and acc.aborted_joules == 0.0  # the release waits after the steps
    acc.evaluate()
    assert "a" not in acc.table.slots and "b" in acc.table.slots
    assert acc.steps == 3 and acc.total_joules == pytest.approx(eager.total_joules, rel=1e-12)
    assert acc.aborted_joules == pytest.approx(a_share, rel=1e-12) and a_share > 0
    assert acc.unsent_joules == 0.0 and acc.tracked_requests == 1
    ours, theirs = acc.record("b"), eager.record("b")
    assert ours.components == pytest.approx(theirs.components, rel=1e-12)  # summed in
    assert replace(ours, components=theirs.components) == theirs  # another order


def test_the_steps_waiting_go_to_the_predictor_in_one_call(monkeypatch) -> None:
    """An evaluation predicts the steps waiting in one `run_many` call; the totals are a
    dense engine's."""
    from vllm_piep.predict.stepgraph import StepGraph

    calls: list[int] = []
    run_many = StepGraph.run_many

    def counted(self, sched, prompt, seconds, starts):  # type: ignore[no-untyped-def]
        calls.append(len(starts))
        return run_many(self, sched, prompt, seconds, starts)

    monkeypatch.setattr(StepGraph, "run_many", counted)
    steps = 4 * MAX_UNEVALUATED
    _, acc = _play(5, 8, steps, False, 0.0, 0.0, True, finish_p=0.0)
    _, dense_acc = _play(5, 8, steps, False, 0.0, 0.0, False, finish_p=0.0)
    assert acc.steps == dense_acc.steps == steps
    assert calls == [MAX_UNEVALUATED] * (steps // MAX_UNEVALUATED)
    assert acc.warmup.ready  # the warm-up rule judged the steps evaluated together
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


def _held_engine() -> tuple[EngineAccountant, list[tuple[int, list]], list[int]]:
    """A served sparse engine on a clock the test moves, its own outputs collected."""
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    clock = [0]
    acc = EngineAccountant(lambda: prior, clock_ns=lambda: clock[0])
    acc.sparse = True
    sent: list[tuple[int, list]] = []
    acc.put_outputs = lambda client, outs: sent.append((client, outs))
    return acc, sent, clock


def _step(acc: EngineAccountant, key: int, req_ids: list[str], clock: list[int]) -> None:
    from vllm_piep.runtime.engine_core.scheduled import ScheduledStep

    sched = np.array([[40.0] * len(req_ids), [1.0] * len(req_ids), [8.0] * len(req_ids),
                      [1.0] * len(req_ids)])
    acc.on_schedule(key, ScheduledStep(req_ids, sched, {r: 32 for r in req_ids}),
                    at_ns=clock[0])
    clock[0] += 1_000_000
    acc.on_step_done(key, worker_step_ns=1_000_000, at_ns=clock[0])


def test_a_finishing_output_waits_for_the_pass_at_most_hold_s_and_carries_its_total() -> None:
    from support.engine_loop import outputs_of

    from vllm_piep.runtime.engine_core import (
        output_records,
    )
    from vllm_piep.runtime.engine_core.accountant import HOLD_S
    from vllm_piep.runtime.record import PICK_DTYPE, PICKS_KEY

    acc, sent, clock = _held_engine()
    _step(acc, 0, ["a", "b"], clock)
    outs = outputs_of(["a", "b"], ["a"])
    output_records.attach_records(acc, outs)
    assert [o.request_id for o in outs[0].outputs] == ["b"] and acc.holding == {"a"}
    assert acc.steps == 0 and outs[0].outputs[0].kv_transfer_params is None  # nothing read
    acc.evaluate()  # the pass: step 0, then a's output, released with what step 0 gave it
    ready = acc.take_ready()
    assert [r.output.request_id for r in ready] == ["a"] and not acc.holding
    a_total = ready[0].row[COLUMN["prefill"]] + ready[0].row[COLUMN["decode"]]
    assert a_total > 0 and "a" not in acc.table.slots
    assert acc.total_joules == pytest.approx(a_total + acc.record("b").joules, rel=1e-12)
    # Again, read by nothing: the next batch after HOLD_S takes it, with step 1 still unread.
    _step(acc, 1, ["b", "c"], clock)
    outs = outputs_of(["b", "c"], ["c"])
    output_records.attach_records(acc, outs)
    assert acc.holding == {"c"}
    clock[0] += int(HOLD_S * 1e9)
    _step(acc, 2, ["b"], clock)
    outs = outputs_of(["b"], [])
    output_records.attach_records(acc, outs)
    assert [o.request_id for o in outs[0].outputs] == ["b", "c"] and not acc.holding
    params = outs[0].outputs[0].kv_transfer_params
    assert np.frombuffer(params[PICKS_KEY], PICK_DTYPE).tolist() == [1]
    c_row = np.frombuffer(params[output_records.ROWS_KEY], ROW_DTYPE)[0]
    assert c_row["prefill"] + c_row["decode"] > 0
    assert acc.steps == 3 and "c" not in acc.table.slots
    assert sent == []  # every held output went out with a batch of its client


def test_an_idle_engine_sends_held_outputs_at_once() -> None:
    import queue
    from types import SimpleNamespace

    from support.engine_loop import outputs_of

    from vllm_piep.runtime.engine_core import (
        output_records,
        patch_notify_idle,
        scheduler_accountant,
    )

    acc, sent, clock = _held_engine()
    _step(acc, 0, ["a", "b"], clock)
    outs = outputs_of(["a", "b"], ["a", "b"])
    output_records.attach_records(acc, outs)
    assert outs[0].outputs == [] and acc.holding == {"a", "b"}
    acc.meter_tried = True  # no measured mode here
    scheduler = SimpleNamespace(requests={})
    scheduler.__dict__[scheduler_accountant.ACCOUNTANT_ATTR] = acc
    engine = SimpleNamespace(scheduler=scheduler, output_queue=queue.Queue())
    patch_notify_idle.flush_idle(engine)
    assert [[o.request_id for o in batch] for _, batch in sent] == [["a", "b"]]
    rows = np.frombuffer(sent[0][1][0].kv_transfer_params[output_records.ROWS_KEY], ROW_DTYPE)
    assert np.all(rows["prefill"] + rows["decode"] > 0)
    assert not acc.holding and len(acc.table) == 0 and acc.after_finish_joules == 0.0
    counted = float((rows["prefill"] + rows["decode"]).sum()) + acc.warmup_joules
    assert counted == pytest.approx(acc.total_joules, rel=1e-12)
    assert not acc.unreported()  # the counts went out with them


def test_a_late_step_of_a_request_released_in_an_earlier_pass_counts_as_unsent() -> None:
    """Async scheduling: a request aborted while a step naming it is in flight, the release
    evaluated before that step: the step's share of it is unsent energy, as a dense engine
    counts it, whether the pass adds its steps as columns or one by one."""
    from vllm_piep.runtime.engine_core.scheduled import ScheduledStep

    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    dense, sparse = EngineAccountant(lambda: prior), EngineAccountant(lambda: prior)
    sparse.sparse = True
    sched = np.array([[40.0, 40.0], [1.0, 1.0], [8.0, 8.0], [1.0, 1.0]])
    passes, late = [], []
    for acc in (dense, sparse):
        for key in range(12):  # the warm-up rule is ready after these
            acc.on_schedule(key, ScheduledStep(["a", "b"], sched + key,
                                               {"a": 16, "b": 32} if key == 0 else {}),
                            at_ns=key * 10)
            acc.on_step_done(key, worker_step_ns=1_000_000, at_ns=key * 10 + 5)
        acc.evaluate()
        assert acc.warmup.ready
        acc.on_schedule(99, ScheduledStep(["a", "b"], sched + 20, {}), at_ns=200)
        acc.release("a")  # aborted, its step in flight (the log is empty: released now)
        assert "a" not in acc.table.slots
        before = acc.unsent_joules
        apply = acc._apply_columns
        acc._apply_columns = lambda *args, _a=apply: (passes.append(1), _a(*args))[1]
        acc.on_step_done(99, worker_step_ns=1_000_000, at_ns=205)
        acc.evaluate()
        late.append(acc.unsent_joules - before)  # the late step's share of "a"
    assert passes == [1]  # the sparse pass added its step as columns
    assert late[1] > 0.0 and late[1] == pytest.approx(late[0], rel=1e-9)
    assert "a" not in sparse.table.slots and sparse.tracked_requests == 1
    assert sparse.total_joules == pytest.approx(dense.total_joules, rel=1e-9)
