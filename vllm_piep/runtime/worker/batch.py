"""What a step computed, read off the scheduler output the worker gets (no vLLM imports): its
counts for the step's span, and its shape for repeated sampling."""

from __future__ import annotations

from typing import Any


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
