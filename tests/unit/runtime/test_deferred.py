"""The engine loop queues the accounting and vLLM's output thread runs it: the same records go
out as when the loop runs it itself, byte for byte, the engine's counts are the same, and the
loop runs none of it."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_piep.model.devices import DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.deferred import MAX_QUEUED, DeferredCalls

pytest.importorskip("vllm")

from support.engine_loop import PlayedEngine, Workload, outputs_of  # noqa: E402

from vllm_piep.runtime.engine_core import (  # noqa: E402
    patch_schedule,
    patch_update_from_output,
    scheduler_accountant,
)
from vllm_piep.runtime.record import PICKS_KEY, ROWS_KEY, RowCursor, decode_row  # noqa: E402
from vllm_piep.runtime.worker.step import STEP_TIME_ATTR  # noqa: E402
from vllm_piep.runtime.worker.steptime import HOST_TIMER, KnownStepTime  # noqa: E402

SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=4)


def test_queued_calls_run_in_order_and_a_failing_one_stops_none_of_the_rest() -> None:
    ran: list[int] = []
    failures: list[str] = []
    calls = DeferredCalls(lambda name, exc: failures.append(name))

    def boom() -> None:
        raise RuntimeError("a bad step")

    assert calls.add(ran.append, 1)  # nothing runs them elsewhere yet: due on the loop
    calls.add(boom)
    calls.add(ran.append, 2)
    assert calls.due_on_loop() and len(calls) == 3
    assert calls.run() == 3 and ran == [1, 2] and failures == ["boom"]
    calls.off_loop = True
    assert not any([calls.add(ran.append, i) for i in range(MAX_QUEUED)])
    assert not calls.due_on_loop()
    assert calls.add(ran.append, -1)  # past the bound the loop runs them after all
    assert calls.due_on_loop()


def _prior() -> PriorPredictor:
    return PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))


def _play(seed: int, n: int, steps: int, async_scheduling: bool, abort_p: float,
          off_loop: bool) -> tuple[list[bytes], EngineAccountant, list[str]]:
    prior = _prior()
    acc = EngineAccountant(lambda: prior)
    threads: list[str] = []
    original = acc.on_step_done
    engine: PlayedEngine | None = None

    def on_step_done(*args, **kwargs) -> None:  # where the step's prediction runs
        name = threading.current_thread().name
        threads.append(f"{name}:{engine.phase}" if name == "MainThread" and engine else name)
        original(*args, **kwargs)

    acc.on_step_done = on_step_done  # type: ignore[method-assign]
    jitter = random.Random(seed)
    # The output thread lags the loop by up to a few steps, at random.
    engine = PlayedEngine(acc, Workload(n, seed, finish_p=0.08, abort_p=abort_p), off_loop,
                          step_ns=2_000_000,
                          on_encode=lambda: time.sleep(jitter.random() * 0.002))
    engine.run(steps, async_scheduling, lambda: time.sleep(0.0005))
    engine.close()
    return engine.rows, acc, threads


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), n=st.integers(1, 24), async_scheduling=st.booleans(),
       abort_p=st.sampled_from([0.0, 0.05]))
def test_off_the_loop_the_same_records_go_out_and_every_joule_is_counted(
        seed: int, n: int, async_scheduling: bool, abort_p: float) -> None:
    steps = 40
    on_rows, on_acc, on_threads = _play(seed, n, steps, async_scheduling, abort_p, False)
    off_rows, off_acc, off_threads = _play(seed, n, steps, async_scheduling, abort_p, True)
    assert set(on_threads) == {"MainThread:update"}
    # The loop predicts steps inside update_from_output only until the output thread first
    # sends a batch; from then on in the next step's shadow (or, when the output thread gets
    # there first, on that thread), never on the critical path.
    on_path = off_threads.count("MainThread:update")
    assert on_path < steps and off_threads[:on_path] == ["MainThread:update"] * on_path
    assert set(off_threads[on_path:]) <= {"MainThread:shadow", "output-thread"}
    assert "MainThread:shadow" in off_threads
    assert len(off_rows) == len(on_rows) == steps and off_rows == on_rows  # byte for byte
    on, off = on_acc.counts(), off_acc.counts()
    for a, b in zip(on[:-1], off[:-1], strict=True):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    assert on.steps_by_timer == off.steps_by_timer
    assert off_acc.errors == 0 and off_acc.steps == steps
    # Every request the workload still has is tracked, none that it released.
    assert off_acc.tracked_requests == on_acc.tracked_requests
    # The same requests in the same rows: each joule where the loop would have put it.
    assert np.array_equal(off_acc.table.rows, on_acc.table.rows)


def _play_errors(off_loop: bool, error_at: int | None
                 ) -> tuple[EngineAccountant, list[list[Any]], list[str]]:
    """Three steps of four requests through the plugin's wrappers; at step `error_at` vLLM's
    update finishes the second request as errored (a grammar that failed to compile:
    `finish_requests`, then a final output in the same batch, as `update_from_output` does),
    and the next scheduler output names it among the finished (`finished_req_ids`)."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.request import RequestStatus

    acc = EngineAccountant(_prior)
    acc.sparse = True
    acc.deferred.off_loop = off_loop  # queued (as served) or run inside the update
    work = Workload(4, seed=3, finish_p=0.0, abort_p=0.0)
    scheduler = SimpleNamespace(requests=work.requests)
    scheduler.__dict__[scheduler_accountant.ACCOUNTANT_ATTR] = acc
    mro = SimpleNamespace(**{STEP_TIME_ATTR: KnownStepTime(1_000_000, HOST_TIMER)})

    def finish(self: Any, req_ids: list[str], status: Any) -> list[Any]:
        return [self.requests.pop(r) for r in req_ids]

    errored: list[str] = []
    ids: list[str] = []

    def vllm_update(self: Any, so: Any, mro: Any) -> dict[int, Any]:
        outs = outputs_of([r for r in ids if r not in errored], [])
        for request in finish(self, errored, RequestStatus.FINISHED_ERROR):
            outs[0].outputs.append(EngineCoreOutput(request_id=request.request_id,
                                                    new_token_ids=[],
                                                    finish_reason=FinishReason.ERROR))
        return outs

    update = patch_update_from_output._wrap_update_from_output(vllm_update)
    sent = []
    for step in range(4):  # the fourth is scheduled only: it names the errored one as finished
        so, ids, _, _ = work.step()
        so.finished_req_ids = set(errored)
        if step == error_at:
            errored.append(ids[1])
        patch_schedule._wrap_schedule(lambda self, throttle_prefills, so=so: so)(scheduler, False)
        if step < 3:
            sent.append(update(scheduler, so, mro)[0].outputs)
        scheduler_accountant.run_deferred(acc)  # what the loop's shadow or the output thread does
    return acc, sent, errored


@pytest.mark.parametrize("off_loop", [False, True])
def test_a_request_vllm_finishes_inside_its_update_carries_its_row_then_is_released(
        off_loop: bool) -> None:
    acc, sent, (errored,) = _play_errors(off_loop, error_at=2)
    last = sent[-1][-1]
    assert last.request_id == errored and last.finish_reason is not None
    params = sent[-1][0].kv_transfer_params
    cursor = RowCursor(None, params[ROWS_KEY], params.get(PICKS_KEY))
    rows = [cursor.take() for _ in sent[-1]]
    assert rows[-1] is not None and rows[:-1] == [None] * 3  # only the finished one
    row = decode_row(rows[-1])
    # Its whole energy: what the same request has after the same three steps without error.
    same, _, _ = _play_errors(off_loop, error_at=None)
    expected = same.record(errored)
    assert row["prefill"] == pytest.approx(expected.prefill_joules, rel=1e-12)
    assert row["decode"] == pytest.approx(expected.decode_joules, rel=1e-12)
    assert row["prefill"] + row["decode"] > 0 and row["incomplete"] == 0
    # Released after its output: the other three are tracked, it is not. The next step's
    # finished ids name it, and it is not released again as aborted.
    assert acc.errors == 0 and acc.tracked_requests == 3 == same.tracked_requests - 1
    assert errored not in acc.book.gone and acc.unsent_joules == acc.aborted_joules == 0


@pytest.mark.parametrize("off_loop", [False, True])
def test_a_request_the_scheduler_dropped_without_a_word_is_swept(off_loop: bool) -> None:
    """The loop hands an update the scheduler's requests once the calls before it asked for a
    sweep (every `_SWEEP_EVERY` steps): a request gone without an output or an abort is
    released then, and the others are kept."""
    acc = EngineAccountant(_prior)
    acc.sparse = True
    acc.deferred.off_loop = off_loop
    work = Workload(4, seed=3, finish_p=0.0, abort_p=0.0)
    scheduler = SimpleNamespace(requests=work.requests)
    scheduler.__dict__[scheduler_accountant.ACCOUNTANT_ATTR] = acc
    mro = SimpleNamespace(**{STEP_TIME_ATTR: KnownStepTime(1_000_000, HOST_TIMER)})
    schedule = patch_schedule._wrap_schedule(lambda self, throttle_prefills: self.so)
    tracked = []
    for step in range(2 * patch_update_from_output._SWEEP_EVERY + 2):
        scheduler.so, ids, _, _ = work.step()
        schedule(scheduler, False)
        update = patch_update_from_output._wrap_update_from_output(
            lambda self, so, mro, ids=ids: outputs_of(ids, []))
        update(scheduler, scheduler.so, mro)
        scheduler_accountant.run_deferred(acc)
        if step == 0:
            gone = ids[0]
            del work.live[gone], work.requests[gone]
        tracked.append(acc.tracked_requests)
    assert tracked[patch_update_from_output._SWEEP_EVERY - 1] == 4  # not yet swept
    assert tracked[-1] == 3 and acc.errors == 0
