"""Engine core: `MsgpackEncoder.encode_into` wrapped so that vLLM's output thread sends a batch of
outputs only once the accounting calls the loop queued before it have run (they attach the
records it carries): it waits for the loop without the GIL, up to `_WAIT_FOR_LOOP_S`, then runs
what is left itself (the end of a burst, when the loop has nothing to dispatch). The API
server's encoders find no accountant and pass through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_piep.once import OnceLogger
from vllm_piep.runtime.engine_core.scheduler_accountant import ACCOUNTANTS, run_deferred
from vllm_piep.runtime.patching import Patch

# The loop reaches the next dispatch within vLLM's scheduling time (well under this); when it
# has nothing to dispatch (the end of a burst), the output thread runs the calls itself after it.
_WAIT_FOR_LOOP_S = 0.002
_once = OnceLogger()


def _wrap_encode_into(original: Callable[..., Any]) -> Callable[..., Any]:
    def encode_into(self: Any, obj: Any, buf: Any) -> Any:
        if ACCOUNTANTS:  # an engine core's output thread, about to send a batch of outputs
            try:
                for acc in ACCOUNTANTS:
                    acc.deferred.off_loop = True
                    # The loop runs them once it has handed the next step to the device;
                    # waiting here leaves it the GIL.
                    acc.deferred.wait_run(_WAIT_FOR_LOOP_S)
                    run_deferred(acc)
            except Exception as exc:  # boundary: the outputs go out regardless
                _once.warn("accounting steps on the output thread", exc,
                           "energy of the affected requests may be missing")
        return original(self, obj, buf)

    return encode_into


def patch() -> Patch:
    from vllm.v1.serial_utils import MsgpackEncoder

    return Patch(MsgpackEncoder, "encode_into", _wrap_encode_into,
          why="the outputs of a batch go out only once the step accounting the engine "
              "loop queued before them has run (it attaches their records)",
          how="before the original, when this process has an engine accountant: waits "
              "(without the GIL, up to 2 ms) for the loop to run its queued calls, then "
              "runs what is left under its lock (the API server's encoders find none)",
          until="vLLM offers a per-step hook off the engine loop's critical path, and a "
                "field on EngineCoreOutput for plugins")
