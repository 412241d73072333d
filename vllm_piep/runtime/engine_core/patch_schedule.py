"""Engine core: `Scheduler.schedule` wrapped to keep, right after scheduling, what each request
computes in the step: the scheduler output (whose lists it carries for the workers) and the
scheduler's requests, by reference. The step is read off the loop's critical path, when the
queued call runs (`deferred.py`), and so are the requests vLLM finished since the step before
(`finished_req_ids`, every reason): those no final output released were aborted from outside,
and their state is freed (`EngineAccountant.release_finished`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from vllm_piep.runtime.engine_core.scheduled import NO_NEW, new_requests, raw_step
from vllm_piep.runtime.engine_core.scheduler_accountant import (
    LOOP_ATTR,
    LoopHandle,
    accountant,
    count_failure,
    loop_handle,
    run_deferred,
)
from vllm_piep.runtime.patching import Patch


def _schedule_later(loop: LoopHandle, scheduler_output: Any,
                    requests: dict[str, Any], at_ns: int) -> None:
    acc = loop.acc
    finished = scheduler_output.finished_req_ids  # a set of its own: vLLM makes a new one
    if finished:
        acc.release_finished(finished)
    if scheduler_output.total_num_scheduled_tokens <= 0:
        return  # a step of no work: vLLM schedules one to hand over finished ids
    new_reqs = scheduler_output.scheduled_new_reqs
    new = new_requests(new_reqs, requests) if new_reqs else NO_NEW
    if new.dense:
        acc.dense_ids.update(new.dense)
    # Converted when the step is accounted, at its update (`EngineAccountant.on_schedule`).
    acc.steps_table.scheduled(id(scheduler_output), partial(raw_step, scheduler_output, new),
                              at_ns)


def _wrap_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    # The engine loop's wrappers mirror their originals' parameters (`Patch.signature`):
    # `*args, **kwargs` would build a tuple and a dict per call, on the critical path.
    def schedule(self: Any, throttle_prefills: bool = False) -> Any:
        out = original(self, throttle_prefills)
        try:
            # On the loop's critical path: the scheduler output and the scheduler's requests
            # are kept by reference (copying or looking up touches every element, slow on a
            # cold cache); the new requests are read off the loop (`new_requests`), and so is
            # whether the step schedules anything.
            loop = self.__dict__.get(LOOP_ATTR) or loop_handle(self)
            loop.queue((_schedule_later, (loop, out, self.requests, loop.now_ns())))
            if not loop.deferred.off_loop:
                # Nothing runs the calls off the loop yet: run them now, before a request of
                # this step can leave the scheduler. (The update's wrapper, one per step, also
                # runs them when too many wait.)
                run_deferred(loop.acc)
        except Exception as exc:  # boundary: never break scheduling
            count_failure(self, "reading the scheduled step", exc)
            try:
                acc = accountant(self)
                acc.deferred.add(acc.mark_incomplete, list(out.num_scheduled_tokens))
            except Exception:
                pass  # already counted and logged above
        return out

    return schedule


def patch() -> Patch:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Patch(Scheduler, "schedule", _wrap_schedule,
          why="captures each scheduled request's new tokens and context for the step, and "
              "frees the state of requests aborted from outside (client gone, stop strings "
              "found by the API server)",
          how="after the original, keeps the scheduler output and the scheduler's dict "
              "of requests by reference and queues the step for the accountant, which reads "
              "the lists it carries for the workers, its new requests and its "
              "finished_req_ids off the loop",
          until="vLLM offers a per-step hook with the scheduler output",
          signature="(self, throttle_prefills=False)")
