"""Workers: time each engine step where the model runs, and send the time with the step's output.

`Worker.execute_model` and `Worker.sample_tokens` (vLLM splits a step in two: the forward pass,
then sampling) are wrapped with the worker's step clock (`steptime.py`): CUDA events on a GPU,
`perf_counter_ns` on a CPU. The step's time rides on the `ModelRunnerOutput` that carries its
sampled tokens, as `piep_step_ns` (and the timer's name as `piep_step_timer`), however vLLM
hands that output over:

- a plain `ModelRunnerOutput` (V1 model runner without async scheduling, CPU): stamped when the
  worker call returns;
- an `AsyncModelRunnerOutput` (model runner V2 always; V1 with async scheduling): its
  `get_output()`, which the executor calls later and outside the worker's methods
  (`UniProcExecutor` in the engine core's loop, `MultiprocExecutor` and Ray in the worker's
  output thread), is wrapped on that instance to stamp the output it returns.

The output is pickled to the engine core by the multiprocess and Ray executors, so the
attributes survive; the engine core reads them in `update_from_output`
(`runtime/engine_core/scheduler.py`), and counts a step without them under a labelled
fallback. Outputs without requests (vLLM's shared `EMPTY_MODEL_RUNNER_OUTPUT`,
KV-connector-only outputs) are never stamped.

With a `spans_dir` configured (see `detail.py`), the same wrappers open and close the rank's
step span in its `StepRecorder`: begun when `execute_model` is entered, ended when the step's
last call returns; the step's scheduler output goes with it, counted (`batch.StepCounter`) on the
span writer's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_piep.once import OnceLogger
from vllm_piep.runtime.patching import Patch
from vllm_piep.runtime.worker.batch import sample_key
from vllm_piep.runtime.worker.steptime import NoStepClock, StepClock, StepTime, step_clock

STEP_NS_ATTR = "piep_step_ns"
STEP_TIMER_ATTR = "piep_step_timer"
RECORDER_ATTR = "_piep_recorder"  # where a worker keeps its span recorder (`detail.py`)
_CLOCK = "_piep_step_clock"
_once = OnceLogger("further failures of this kind are not logged; those steps are counted "
                   "under piep_engine_steps_total{step_time=\"engine_clock\"}")


def _clock_failed(exc: BaseException) -> None:
    _once.warn("timing a step", exc, "the engine times that step itself")


def worker_clock(worker: Any) -> StepClock:
    """The worker's step clock, made at its first step for the device it runs on (one that
    cannot be made leaves the worker's steps untimed). Its methods never raise."""
    clock = worker.__dict__.get(_CLOCK)
    if clock is None:
        try:
            device = getattr(worker, "device", None)
            kind = str(getattr(device, "type", device or "cpu")).split(":", 1)[0]
            clock = step_clock(kind, _clock_failed)
        except Exception as exc:  # boundary: never break a step
            _clock_failed(exc)
            clock = NoStepClock()
        worker.__dict__[_CLOCK] = clock
    return clock


def stamp(output: Any, time: StepTime) -> None:
    """Put the step's time on a model runner output that carries requests."""
    try:
        if getattr(output, "req_ids", None):
            setattr(output, STEP_NS_ATTR, time.ns())
            setattr(output, STEP_TIMER_ATTR, time.timer)
    except Exception as exc:  # boundary: the output goes on without its time
        _once.warn("reading the step time", exc, "the engine times that step itself")


def deliver(output: Any, time: StepTime | None) -> None:
    """Stamp a plain output now, or an async output when vLLM asks it for its result."""
    if output is None or time is None:
        return
    if hasattr(output, "req_ids"):
        stamp(output, time)
        return
    get_output = getattr(output, "get_output", None)
    if callable(get_output):
        def get_output_with_step_time() -> Any:
            result = get_output()
            stamp(result, time)
            return result

        try:
            output.get_output = get_output_with_step_time
        except Exception as exc:  # boundary: an output class that forbids it (__slots__)
            _once.warn("following an async model output", exc,
                       "the engine times those steps itself")


def _wrap_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    # With the worker inside the engine core (vLLM 0.33 on one GPU) these wrappers run on the
    # engine loop's critical path: they mirror their originals' parameters (`Patch.signature`;
    # `*args, **kwargs` would build a tuple and a dict per call) and call the clock directly.
    def execute_model(self: Any, scheduler_output: Any) -> Any:
        recorder = self.__dict__.get(RECORDER_ATTR)
        if recorder is not None:
            recorder.begin_step(sample_key(scheduler_output) if recorder.sampler else None)
        clock = self.__dict__.get(_CLOCK) or worker_clock(self)
        clock.begin()
        output = original(self, scheduler_output)
        if output is None:  # the step continues in sample_tokens
            clock.pause()
            time = None
        else:
            time = clock.end()
            deliver(output, time)
        if recorder is not None:
            recorder.mark_end()
            recorder.set_batch(scheduler_output)
            if output is not None:
                recorder.set_step_time(time)
                recorder.end_step()
        return output

    return execute_model


def _wrap_sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        clock = self.__dict__.get(_CLOCK) or worker_clock(self)
        timed = clock.resume()
        output = original(self, grammar_output)
        time = clock.end() if timed else None
        deliver(output, time)
        recorder = self.__dict__.get(RECORDER_ATTR)
        if recorder is not None:
            recorder.mark_end()  # the step's span ends after its sampling
            recorder.set_step_time(time)
            recorder.end_step()
        return output

    return sample_tokens


def patches() -> list[Patch]:
    from vllm.v1.worker.gpu_worker import Worker

    return [
        Patch(Worker, "execute_model", _wrap_execute_model,
              why="times the step where the model runs (CPU and GPU workers derive from it)",
              how="starts the worker's step clock (a CUDA event on a GPU), ends it when the "
                  "call returns an output, and puts the time on that output (or on the output "
                  "an async output's get_output() returns)",
              until="vLLM reports each step's device time on ModelRunnerOutput",
              signature="(self, scheduler_output)"),
        Patch(Worker, "sample_tokens", _wrap_sample_tokens,
              why="the sampling half of a split step (model runner V2, and V1 when vLLM splits "
                  "the step) ends the step's time",
              how="ends the step clock when sampling returns and stamps its output, or wraps "
                  "get_output() of the AsyncModelRunnerOutput it returns",
              until="vLLM reports each step's device time on ModelRunnerOutput",
              signature="(self, grammar_output)"),
    ]
