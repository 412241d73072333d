"""Workers: time each engine step where the model runs, and send the time with the step's output.

`Worker.execute_model` (and `sample_tokens`, when vLLM splits a step in two) are wrapped with a
`perf_counter_ns` timer; the sum rides on the returned `ModelRunnerOutput` as `piep_step_ns`
(the output is pickled to the engine core, so the attribute survives). The engine core uses it
as the step time of the prior's static energy; without it (async outputs, other executors) it
falls back to its own wall clock. Step time measured where the model runs does not depend on
how busy the API server is.

With a `spans_dir` configured (see `detail.py`), the same wrappers open and close the rank's
step span in its `StepRecorder`: begun when `execute_model` is entered, ended when the step's
last call returns; the step's scheduler output goes with it, counted (`StepCounter`) on the
span writer's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm_piep.hooks.detail import RECORDER_ATTR
from vllm_piep.hooks.patching import Patch

STEP_NS_ATTR = "piep_step_ns"
_PENDING = "_piep_pending_step_ns"


def _stamp(output: Any, ns: int) -> None:
    if output is not None and hasattr(output, "req_ids"):  # a ModelRunnerOutput, not a future
        setattr(output, STEP_NS_ATTR, ns)


class StepCounter:
    """Counts a step from its scheduler output: (prefill tokens, decode tokens, requests,
    cached context tokens, attended causal pairs, sampled rows). A request's scheduled tokens
    are prefill while they lie inside its prompt; a chunk of q tokens after c computed ones
    attends to q*c + q*(q+1)/2 pairs; a request is sampled once its prompt is complete.

    Runs on the span writer's thread, one step after another in order, so the step loop only
    keeps a reference to the scheduler output: prompt lengths are learnt from each request's
    first scheduling and forgotten when vLLM reports it finished."""

    def __init__(self) -> None:
        self.prompts: dict[str, int] = {}

    def __call__(self, scheduler_output: Any) -> tuple[int, int, int, int, int, int]:
        prompts = self.prompts
        scheduled = scheduler_output.num_scheduled_tokens
        prefill = total = context = pairs = sampled = 0

        def add(count: int, computed: int, prompt: int) -> None:
            nonlocal prefill, total, context, pairs, sampled
            prefill += max(0, min(count, prompt - computed))
            total += count
            context += computed
            pairs += count * computed + count * (count + 1) // 2
            sampled += computed + count >= prompt

        for new in scheduler_output.scheduled_new_reqs:
            tokens = new.prompt_token_ids
            prompt = len(tokens) if tokens is not None else len(new.prompt_embeds)
            prompts[new.req_id] = prompt
            add(scheduled.get(new.req_id, 0), new.num_computed_tokens, prompt)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            add(scheduled.get(req_id, 0), computed, prompts.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            prompts.pop(req_id, None)
        return prefill, total - prefill, len(scheduled), context, pairs, sampled


def sample_key(scheduler_output: Any) -> tuple[int, bool] | None:
    """The step's shape for repeated sampling: (requests, whether any prompt token is computed),
    None for a step without requests. The same on every rank: all get the same output."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    if not scheduled:
        return None
    prefill = bool(scheduler_output.scheduled_new_reqs) or (
        scheduler_output.total_num_scheduled_tokens > len(scheduled))
    return len(scheduled), prefill


def _wrap_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = self.__dict__.get(RECORDER_ATTR)
        if recorder is not None:
            recorder.begin_step(sample_key(scheduler_output) if recorder.sampler else None)
        start = time.perf_counter_ns()
        output = original(self, scheduler_output, *args, **kwargs)
        elapsed = time.perf_counter_ns() - start
        if output is None:  # the step continues in sample_tokens
            self.__dict__[_PENDING] = elapsed
        else:
            _stamp(output, elapsed)
        if recorder is not None:
            recorder.add_worker_ns(elapsed)
            recorder.mark_end()
            recorder.set_batch(scheduler_output)
            if output is not None:
                recorder.end_step()
        return output

    return execute_model


def _wrap_sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        output = original(self, *args, **kwargs)
        elapsed = time.perf_counter_ns() - start
        _stamp(output, elapsed + self.__dict__.pop(_PENDING, 0))
        recorder = self.__dict__.get(RECORDER_ATTR)
        if recorder is not None:
            recorder.add_worker_ns(elapsed)
            recorder.mark_end()  # the step's span ends after its sampling
            recorder.end_step()
        return output

    return sample_tokens


def patches() -> list[Patch]:
    from vllm.v1.worker.gpu_worker import Worker

    return [
        Patch(Worker, "execute_model", _wrap_execute_model,
              why="times the step where the model runs (CPU and GPU workers derive from it)"),
        Patch(Worker, "sample_tokens", _wrap_sample_tokens,
              why="adds the sampling half of a split step to its time"),
    ]
