"""Engine core: `Scheduler.get_grammar_bitmask` wrapped to run the loop's queued accounting calls
right after the loop has handed a step to the device (vLLM asks for the step's grammar bitmask
then), in the device's shadow, off the critical path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_piep.runtime.engine_core.scheduler_accountant import (
    ACCOUNTANT_ATTR,
    count_failure,
    run_deferred,
)
from vllm_piep.runtime.patching import Patch


def _wrap_get_grammar_bitmask(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_grammar_bitmask(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        acc = self.__dict__.get(ACCOUNTANT_ATTR)
        if acc is not None and acc.deferred.off_loop:
            # The step is on the device: the loop accounts the steps before it in its shadow.
            try:
                run_deferred(acc)
            except Exception as exc:  # boundary
                count_failure(self, "accounting a step", exc)
        return result

    return get_grammar_bitmask


def patch() -> Patch:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Patch(Scheduler, "get_grammar_bitmask", _wrap_get_grammar_bitmask,
          why="the loop accounts the steps before it while the device computes the step "
              "it has just handed over (off the critical path)",
          how="after the original (called right after each step is dispatched), runs the "
              "queued accounting calls under the accountant's lock",
          until="vLLM offers a per-step hook off the engine loop")
