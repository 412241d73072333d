"""The schedule wrapper keeps a step on the loop's critical path by reference (the scheduler's
lists, its dict of `Request`s) and reads it off the loop: what it reads there is what the
scheduler scheduled, even when the scheduler has dropped a request by then."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import numpy as np
import pytest

from vllm_piep.runtime.engine_core import patch_schedule, scheduler_accountant
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.scheduled import ScheduledStep

pytest.importorskip("vllm")


def _engine(off_loop: bool) -> tuple[Any, EngineAccountant]:
    acc = EngineAccountant(lambda: None)  # nothing is predicted here
    acc.deferred.off_loop = off_loop
    requests = {
        "a": NS(num_prompt_tokens=30, num_output_tokens=10, sampling_params=NS(stop=[])),
        "b": NS(num_prompt_tokens=20, num_output_tokens=0, sampling_params=NS(stop=["\n"])),
    }
    scheduler = NS(requests=requests)
    scheduler.__dict__[scheduler_accountant.ACCOUNTANT_ATTR] = acc
    return scheduler, acc


def _output(spec: dict[str, list[int]] | None = None) -> Any:
    """Request a running with 40 tokens computed (and 3 draft tokens with `spec`), b new."""
    spec = spec or {}
    scheduled = {"a": 1 + len(spec.get("a", ())), "b": 20}
    return NS(total_num_scheduled_tokens=sum(scheduled.values()),
              num_scheduled_tokens=scheduled,
              scheduled_new_reqs=[NS(req_id="b", num_computed_tokens=0,
                                     prompt_token_ids=list(range(20)), prompt_embeds=None,
                                     sampling_params=NS(stop=["\n"]))],
              scheduled_cached_reqs=NS(req_ids=["a"], num_computed_tokens=[40],
                                       num_output_tokens=[10]),
              scheduled_spec_decode_tokens=spec, finished_req_ids=set())


def _step(acc: EngineAccountant, out: Any) -> ScheduledStep:
    made, _ = acc.steps_table.pending[id(out)]
    assert callable(made)
    return ScheduledStep.of_raw(made())


def test_a_new_request_the_scheduler_dropped_before_the_step_is_read_still_counts() -> None:
    scheduler, acc = _engine(off_loop=True)
    out = _output()
    patch_schedule._wrap_schedule(lambda self, throttle_prefills: out)(scheduler, False)
    assert len(acc.deferred) == 1  # queued: nothing read on the loop
    del scheduler.requests["b"]  # aborted before the loop ran the queued calls
    with acc.lock:
        acc.deferred.run()
    step = _step(acc, out)
    assert step.req_ids == ["a", "b"]
    # computed before the step, scheduled, outputs so far, draws
    np.testing.assert_array_equal(step.sched, [[40, 0], [1, 20], [10, 0], [1, 1]])
    assert step.new_prompts == {"b": 20}  # its prompt, from the scheduler output
    assert acc.dense_ids == {"b"}  # and its stop strings


def test_a_new_request_is_read_from_the_schedulers_request_off_the_loop() -> None:
    """A preempted request model runner V2 resumes is new to the step with its outputs so
    far, which only the scheduler's `Request` has."""
    scheduler, acc = _engine(off_loop=True)
    out = _output()
    patch_schedule._wrap_schedule(lambda self, throttle_prefills: out)(scheduler, False)
    scheduler.requests["b"].num_output_tokens = 7  # resumed after 7 outputs
    scheduler.requests["b"].num_prompt_tokens = 19
    with acc.lock:
        acc.deferred.run()
    step = _step(acc, out)
    np.testing.assert_array_equal(step.sched[2], [10, 7])
    assert step.new_prompts == {"b": 19}


def test_without_an_output_thread_the_step_is_read_before_the_update_can_free_it() -> None:
    scheduler, acc = _engine(off_loop=False)
    out = _output()
    patch_schedule._wrap_schedule(lambda self, throttle_prefills: out)(scheduler, False)
    assert len(acc.deferred) == 0 and id(out) in acc.steps_table.pending


def test_draft_slots_trimmed_before_the_step_runs_are_read_as_run() -> None:
    """vLLM's in-process n-gram proposer trims rejected draft slots from the scheduler output
    before the step runs (`update_scheduler_for_invalid_drafts`): the step is read as run."""
    scheduler, acc = _engine(off_loop=True)
    out = _output({"a": [7, 8, 9]})
    patch_schedule._wrap_schedule(lambda self, throttle_prefills: out)(scheduler, False)
    out.num_scheduled_tokens["a"] -= 2  # two of the three drafts invalid
    out.scheduled_spec_decode_tokens["a"] = [7]
    with acc.lock:
        acc.deferred.run()
    np.testing.assert_array_equal(_step(acc, out).sched[[1, 3]], [[2, 20], [2, 1]])


@pytest.mark.parametrize("off_loop", [True, False])
def test_a_step_that_schedules_nothing_is_not_accounted(off_loop: bool) -> None:
    """Whether a step schedules anything is read off the loop, with the rest of it."""
    scheduler, acc = _engine(off_loop)
    empty = NS(total_num_scheduled_tokens=0, num_scheduled_tokens={}, scheduled_new_reqs=[],
               scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[],
                                        num_output_tokens=[]),
               scheduled_spec_decode_tokens={}, finished_req_ids=set())
    patch_schedule._wrap_schedule(lambda self, throttle_prefills: empty)(scheduler, False)
    with acc.lock:
        acc.deferred.run()
    assert acc.steps_table.pending == {} and acc.errors == 0
    out = _output()
    patch_schedule._wrap_schedule(lambda self, throttle_prefills: out)(scheduler, False)
    with acc.lock:
        acc.deferred.run()
    assert list(acc.steps_table.pending) == [id(out)]


def test_the_loop_wrappers_hand_vllms_arguments_on_as_vllm_passes_them() -> None:
    """The wrappers mirror their originals' parameters (`Patch.signature`), so vLLM's own calls
    (positional, as its engine core makes them, or by keyword) reach the original unchanged."""
    scheduler, acc = _engine(off_loop=True)
    seen: list[Any] = []
    out = _output()

    def schedule(self: Any, throttle_prefills: bool = False) -> Any:
        seen.append(throttle_prefills)
        return out

    wrapped = patch_schedule._wrap_schedule(schedule)
    assert wrapped(scheduler) is out and wrapped(scheduler, True) is out
    assert wrapped(scheduler, throttle_prefills=True) is out
    assert seen == [False, True, True]
    assert acc.errors == 0 and len(acc.deferred) == 3  # each step queued