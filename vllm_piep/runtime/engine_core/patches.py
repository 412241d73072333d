"""Engine core: predict every step's energy and put each request's running total on its output.

The patches, one module each, named after what they patch:

- `patch_schedule.py` (`Scheduler.schedule`): keeps, right after scheduling, what each request
  computes in the step (the lists `SchedulerOutput` carries for the workers, by reference), and
  the requests vLLM finished since the step before (`finished_req_ids`): those aborted from
  outside are freed.
- `patch_update_from_output.py` (`Scheduler.update_from_output`): predicts the step once its
  output is back and attaches the outputs' running totals (`output_records.py`: one rows block
  per batch on the first output's `kv_transfer_params`, which the API server pops before vLLM
  reads the field). In prediction mode the engine is sparse (`accountant.py`): only the
  outputs that finish a request, and every output of a request with stop strings (which the
  API server may finish itself), carry a row; each step is accounted at its update.
- `patch_get_grammar_bitmask.py`, `patch_encode_into.py`: where the queued work runs.
- `patch_notify_idle.py` (`EngineCoreProc._notify_idle_state_callbacks`): the idle flush.
- `patch_run_busy_loop.py` (`EngineCoreProc.run_busy_loop`, the data-parallel engine's): the
  accountant set up when the built engine starts serving (its output queue; measured mode's
  meter thread).

None of that work is on the engine loop's critical path (from a step's output to the next
step's dispatch): the wrappers only keep the step and queue the accountant's calls
(`deferred.py`). The loop runs them once it has handed the next step to the device, while the
device computes it (vLLM asks for the step's grammar bitmask right then). vLLM's output thread
waits for them, without the GIL, before it serializes the outputs they attach records to, and
runs them itself when the loop has nothing to dispatch. An in-process engine (no output
thread) runs them inside `update_from_output`.
"""

from __future__ import annotations

from vllm_piep.runtime.engine_core import (
    patch_encode_into,
    patch_get_grammar_bitmask,
    patch_notify_idle,
    patch_run_busy_loop,
    patch_schedule,
    patch_update_from_output,
)
from vllm_piep.runtime.patching import Patch


def patches() -> list[Patch]:
    """The engine core's patches, one module each (`patch_<target>.py`)."""
    return [patch_schedule.patch(), patch_update_from_output.patch(), patch_encode_into.patch(),
            patch_get_grammar_bitmask.patch(), patch_notify_idle.patch(),
            *patch_run_busy_loop.patches()]
