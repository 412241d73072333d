"""Workers: time each engine step where the model runs, and send the time with the step's output.

`Worker.execute_model` and `Worker.sample_tokens` (vLLM splits a step in two: the forward pass,
then sampling) are wrapped with the worker's step clock (`steptime.py`): CUDA events on a GPU,
`perf_counter_ns` on a CPU. The step's time rides on the `ModelRunnerOutput` that carries its
sampled tokens, as `piep_step_time` (a `StepTime`), put there when the step's last call returns,
before vLLM waits for the device:

- a plain `ModelRunnerOutput` (V1 model runner without async scheduling, CPU): itself;
- model runner V2's `AsyncOutput` (vLLM 0.33's default): the `model_runner_output` it holds
  and its `get_output()` returns;
- any other `AsyncModelRunnerOutput` (V1 with async scheduling): its `get_output()`, which the
  executor calls later, is wrapped on that instance to put the time on the output it returns.

So nothing of the plugin's runs after the wait on the device, which on a GPU engine core with the
worker inside it (`UniProcExecutor`) is the engine loop's critical path. A GPU step's time is
read from its events later (`read_step_time`): off the loop in the engine core
(`runtime/engine_core/patch_update_from_output.py`), or, where the multiprocess and Ray
executors pickle the output to the engine core, in the worker's output thread, which sends the
number. The engine core counts a step without a time under a labelled fallback. Outputs without
requests (vLLM's shared `EMPTY_MODEL_RUNNER_OUTPUT`, KV-connector-only outputs) are never
stamped.

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

STEP_TIME_ATTR = "piep_step_time"
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


def read_step_time(model_runner_output: Any) -> tuple[int | None, str | None]:
    """The step's duration in ns and its timer's name, or (None, None) when the output came
    without one or it cannot be read. Never raises."""
    time = getattr(model_runner_output, STEP_TIME_ATTR, None)
    if time is None:
        return None, None
    try:
        return time.ns(), time.timer
    except Exception as exc:  # boundary: the step is counted under the engine's clock
        _once.warn("reading the step time", exc, "the engine times that step itself")
        return None, None


def _stamp(output: Any, time: StepTime) -> None:
    try:
        if getattr(output, "req_ids", None):
            setattr(output, STEP_TIME_ATTR, time)
    except Exception as exc:  # boundary: the output goes on without its time
        _once.warn("stamping the step time", exc, "the engine times that step itself")


def deliver(output: Any, time: StepTime | None) -> None:
    """Put the step's time on the model runner output it belongs to, or, for an async output
    that does not hold it yet, on the one its `get_output()` returns."""
    if output is None or time is None:
        return
    if hasattr(output, "req_ids"):  # a plain ModelRunnerOutput
        _stamp(output, time)
        return
    held = getattr(output, "model_runner_output", None)  # model runner V2's AsyncOutput
    if held is not None:
        _stamp(held, time)
        return
    get_output = getattr(output, "get_output", None)
    if callable(get_output):
        def get_output_with_step_time() -> Any:
            result = get_output()
            _stamp(result, time)
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
        state = self.__dict__
        recorder = state.get(RECORDER_ATTR)
        if recorder is not None:
            recorder.begin_step(sample_key(scheduler_output) if recorder.sampler else None)
        clock = state.get(_CLOCK) or worker_clock(self)
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
        state = self.__dict__
        clock = state.get(_CLOCK) or worker_clock(self)
        timed = clock.resume()
        output = original(self, grammar_output)
        time = clock.end() if timed else None
        if time is not None:
            # Model runner V2's AsyncOutput (vLLM 0.33's default) inline: one read and one
            # write, where a call to `deliver` costs its frame and its checks on the loop
            # (3-8 µs a step here, benchmarks/worker_wrappers_cost.py --clocks cuda).
            held = getattr(output, "model_runner_output", None)
            try:
                if held is not None and held.req_ids:
                    held.piep_step_time = time  # STEP_TIME_ATTR
                else:
                    deliver(output, time)
            except Exception as exc:  # boundary: the output goes on without its time
                _once.warn("stamping the step time", exc, "the engine times that step itself")
        recorder = state.get(RECORDER_ATTR)
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
                  "call returns an output, and puts the time on that output (or on the one an "
                  "async output holds or its get_output() returns)",
              until="vLLM reports each step's device time on ModelRunnerOutput",
              signature="(self, scheduler_output)"),
        Patch(Worker, "sample_tokens", _wrap_sample_tokens,
              why="the sampling half of a split step (model runner V2, and V1 when vLLM splits "
                  "the step) ends the step's time",
              how="ends the step clock when sampling returns and stamps its output (model "
                  "runner V2: the one its AsyncOutput holds; else wraps get_output())",
              until="vLLM reports each step's device time on ModelRunnerOutput",
              signature="(self, grammar_output)"),
    ]
