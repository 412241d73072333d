"""Engine core: `Scheduler.update_from_output` wrapped to queue, for each step, one call that
predicts the step once its output is back (with the worker's step time) and attaches the
outputs' running totals (`output_records.py`), releasing the requests that finished with them
(errors vLLM finishes inside the update too: their final output is in its batch). The call runs
off the loop's critical path (`deferred.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_piep.runtime.engine_core.deferred import MAX_QUEUED
from vllm_piep.runtime.engine_core.output_records import attach_records
from vllm_piep.runtime.engine_core.scheduler_accountant import (
    LOOP_ATTR,
    LoopHandle,
    count_failure,
    loop_handle,
    run_deferred,
)
from vllm_piep.runtime.patching import Patch
from vllm_piep.runtime.worker.step import read_step_time

_SWEEP_EVERY = 256  # steps between sweeps for requests aborted without a final output


def _update_done(loop: LoopHandle, scheduler_output: Any, model_runner_output: Any,
                 at_ns: int, outputs: dict[int, Any] | None, missing: set[str] | None) -> None:
    """A step's update, queued in one call: the step is done (at `at_ns`), then its outputs
    carry their totals (`outputs`: None when the update raised). `missing`, when a sweep was
    due: the requests tracked then that the scheduler no longer had."""
    acc = loop.acc
    try:
        step_ns, timer = read_step_time(model_runner_output)  # a GPU's: read from its events
        acc.on_step_done(id(scheduler_output), step_ns, timer, at_ns=at_ns)
    finally:  # a step that failed is counted; its outputs still go out with their records
        if outputs is not None:
            acc.loop_steps += 1
            if acc.loop_steps % _SWEEP_EVERY == 0:
                loop.sweep_due = True  # the next update looks for requests gone
            if missing is not None:
                loop.sweep_due = False
            # A copy, taken here: vLLM adds an entry to an empty dict after the update
            # (`_attach_iteration_details`) and sends what this call attaches.
            attach_records(acc, dict(outputs), missing)


def _wrap_update_from_output(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        # On the critical path: the outputs and the model output are kept by reference (the
        # step time is read off the loop), and only when the call queued before asked for a
        # sweep, the tracked requests the scheduler no longer has (a difference of key sets:
        # C speed, as many as are tracked, however long the scheduler's queue).
        loop = self.__dict__.get(LOOP_ATTR)
        if loop is None:  # the first step
            try:
                loop = loop_handle(self)
            except Exception as exc:  # boundary
                count_failure(self, "accounting a step", exc)
                return original(self, scheduler_output, model_runner_output)
        at_ns = loop.now_ns()
        outputs = None
        try:
            outputs = original(self, scheduler_output, model_runner_output)
        finally:
            try:
                loop.queue((_update_done, (
                    loop, scheduler_output, model_runner_output, at_ns, outputs,
                    loop.tracked.keys() - self.requests.keys() if loop.sweep_due
                    else None)))
                if not loop.deferred.off_loop or len(loop.deferred.calls) > MAX_QUEUED:
                    run_deferred(loop.acc)
            except Exception as exc:  # boundary
                count_failure(self, "accounting a step", exc)
        return outputs

    return update_from_output


def patch() -> Patch:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Patch(Scheduler, "update_from_output", _wrap_update_from_output,
          why="predicts the step's energy, splits it, attaches running totals to outputs",
          how="after the original, queues one call, run once the next step is "
              "dispatched: predicting and splitting the step (with the worker's step time), "
              "putting the rows block on each client's first output's kv_transfer_params, "
              "then releasing the requests those outputs finish",
          until="vLLM offers a per-step hook with the scheduler and model outputs, and a "
                "field on EngineCoreOutput for plugins",
          signature="(self, scheduler_output, model_runner_output)")
