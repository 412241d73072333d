"""What each request computes in a step, as the accountant takes it: `RawStep`, read off
vLLM's `SchedulerOutput` (`raw_step`, `new_requests`), `ScheduledStep` (converted, or made from
a `StepBatch`), and several steps as columns (`step_columns`). No vLLM imports: the scheduler's
objects are read by attribute."""

from __future__ import annotations

from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from vllm_piep.model.flops import StepBatch
from vllm_piep.predict.stepgraph import raw_inputs


class ScheduledStep(NamedTuple):
    """One scheduled step, as the scheduler holds it (see `predict.stepgraph`)."""

    req_ids: list[str]
    sched: np.ndarray  # [4, N]: computed before the step, scheduled, outputs so far, draws
    new_prompts: dict[str, int]  # prompt lengths of requests the accountant has not seen
    prompt: np.ndarray | None = None  # [1, N] given outright (a `StepBatch`), not stored

    @classmethod
    def of_raw(cls, raw: RawStep) -> ScheduledStep:
        return cls(raw.req_ids, np.array([raw.start[0] + raw.start[1], raw.n(),
                                          raw.outs[0] + raw.outs[1], raw.draws()],
                                         dtype=np.float64), raw.new_prompts)

    @classmethod
    def of_batch(cls, req_ids: list[str], batch: StepBatch) -> ScheduledStep:
        """The scheduler numbers that give exactly this batch's work."""
        sched, prompt = raw_inputs(batch)
        return cls(list(req_ids), sched, {}, prompt)


def step_batch(sched: np.ndarray, prompt: np.ndarray) -> StepBatch:
    """The `StepBatch` of raw scheduler numbers (for predictors without a step graph)."""
    start, n, outs, draws = sched
    end = start + n
    pre = np.maximum(np.minimum(end, prompt) - start, 0.0)
    rows = (end >= prompt + outs) * draws
    return StepBatch(np.column_stack([pre, n - pre, start, rows]))


class NewRequests(NamedTuple):
    """The requests new to a step, as the accountant takes them."""

    ids: list[str]
    start: list[int]
    outs: list[int]
    prompts: dict[str, int]
    dense: list[str]  # those with stop strings: the API server may finish them


def new_requests(new: list[Any], requests: dict[str, Any]) -> NewRequests:
    """The step's new requests (`scheduled_new_reqs`), read off the loop from the scheduler's
    `Request`s (`requests`: its dict, by reference). Read before that step's update, the only
    thing that changes what is read here: the loop runs the queued calls right after it hands
    the step to the device, before it takes aborts. A request already gone (aborted while vLLM
    deferred the step's grammar bitmask) is read from the scheduler output: its prompt, and no
    outputs (exact but for a preempted request model runner V2 resumes)."""
    taken = NewRequests([], [], [], {}, [])
    for r in new:
        req_id = r.req_id
        request = requests.get(req_id)
        taken.ids.append(req_id)
        taken.start.append(r.num_computed_tokens)
        if request is not None:
            taken.outs.append(request.num_output_tokens)  # > 0 only when resumed
            taken.prompts[req_id] = request.num_prompt_tokens
            params = getattr(request, "sampling_params", None)
        else:
            taken.outs.append(0)
            prompt = r.prompt_token_ids if r.prompt_token_ids is not None else r.prompt_embeds
            taken.prompts[req_id] = len(prompt) if prompt is not None else 0
            params = getattr(r, "sampling_params", None)
        if params is not None and params.stop:
            taken.dense.append(req_id)
    return taken


NO_NEW = NewRequests([], [], [], {}, [])  # read only


class RawStep(NamedTuple):
    """One scheduled step as vLLM's lists give it, by reference, not converted yet: a sparse
    engine converts the steps of a pass together (`step_columns`)."""

    req_ids: list[str]  # the cached requests', then the new ones'
    start: tuple[list[int], list[int]]  # tokens computed before the step (cached, new)
    outs: tuple[list[int], list[int]]  # outputs so far (cached, new)
    scheduled: dict[str, int]  # tokens scheduled, by request
    spec_tokens: dict[str, list[int]]  # speculative tokens, by request (empty: none)
    new_prompts: dict[str, int]
    tokens: int = -1  # tokens scheduled in all (vLLM's total); -1: not given, sum `scheduled`

    def n(self) -> list[int]:
        return list(map(self.scheduled.__getitem__, self.req_ids))

    def draws(self) -> list[int]:
        """Sampled positions per request: one, and one per speculative token."""
        spec = self.spec_tokens
        return [1 + len(spec.get(r, ())) for r in self.req_ids] if spec else \
            [1] * len(self.req_ids)


def raw_step(scheduler_output: Any, new: NewRequests) -> RawStep:
    """What each scheduled request computes in the step, as the accountant takes it (off the
    loop), from the lists the scheduler built for the workers (`num_computed_tokens` there is
    the count before this step, so prefix-cache hits and tokens recomputed after preemption
    are accounted as vLLM runs them). The scheduler builds them afresh for every step and
    nothing edits them after `schedule` returns, except the in-process n-gram proposer's trim
    of rejected draft slots before the step runs, which they then read as run."""
    cached = scheduler_output.scheduled_cached_reqs
    return RawStep(cached.req_ids + new.ids, (cached.num_computed_tokens, new.start),
                   (cached.num_output_tokens, new.outs), scheduler_output.num_scheduled_tokens,
                   scheduler_output.scheduled_spec_decode_tokens or {}, new.prompts,
                   scheduler_output.total_num_scheduled_tokens)


def scheduled_step(scheduler_output: Any, new: NewRequests) -> ScheduledStep:
    """`raw_step`, converted."""
    return ScheduledStep.of_raw(raw_step(scheduler_output, new))


class StepColumns(NamedTuple):
    """Several steps side by side: their requests' ids and scheduler numbers in one run of
    columns, each step's first column, and the prompt lengths steps gave outright."""

    req_ids: list[str]
    sched: np.ndarray  # [4, M]
    starts: np.ndarray  # [K]
    given: list[tuple[int, np.ndarray]]  # (step, its [N] prompt lengths) of `of_batch` steps


def step_columns(steps: list[RawStep | ScheduledStep]) -> StepColumns:
    """The steps as columns: vLLM's lists of every step converted in one call per row."""
    sizes = [len(step.req_ids) for step in steps]
    starts = np.zeros(len(steps), dtype=np.intp)
    np.cumsum(sizes[:-1], out=starts[1:])
    ids = list(chain.from_iterable(step.req_ids for step in steps))
    if all(type(step) is RawStep for step in steps):
        raws: list[RawStep] = steps  # type: ignore[assignment]
        m = len(ids)
        sched = np.empty((4, m))
        sched[0] = np.fromiter(chain.from_iterable(p for r in raws for p in r.start),
                               np.float64, m)
        sched[1] = np.fromiter(chain.from_iterable(map(r.scheduled.__getitem__, r.req_ids)
                                                   for r in raws), np.float64, m)
        sched[2] = np.fromiter(chain.from_iterable(p for r in raws for p in r.outs),
                               np.float64, m)
        if any(r.spec_tokens for r in raws):
            sched[3] = np.fromiter(chain.from_iterable(r.draws() for r in raws), np.float64, m)
        else:
            sched[3] = 1.0
        return StepColumns(ids, sched, starts, [])
    made = [step if isinstance(step, ScheduledStep) else ScheduledStep.of_raw(step)
            for step in steps]
    given = [(k, step.prompt[0]) for k, step in enumerate(made) if step.prompt is not None]
    return StepColumns(ids, np.concatenate([step.sched for step in made], axis=1), starts,
                       given)
