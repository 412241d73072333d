"""Repeated sampling inside the workers (PIE-P Appendix L): on a sampled step, run a module or
collective again many times back to back, in a few windows that each last long enough for the
campaign's meter, and record the windows. No vLLM imports: `detail.py` decides where to
call it and supplies how ranks agree on the number of calls.

The energy of a window is read from the campaign's meter log afterwards (`datasets/spans.py`):
the worker only takes timestamps, so the same code serves any meter, and a meter too coarse for
one 20 us module resolves a window of thousands of calls. Replays run on clones of the
module's inputs: a module that updates its input in place (a fused residual-add norm) then
changes only the clone, never the tensors the step goes on with.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import SHORT_WINDOW_RETRIES, calls_per_window, grown_calls


@dataclass(frozen=True)
class ReplayWindows:
    """One module's or collective's repeated sampling in one step."""

    calls: int  # per window
    windows: tuple[tuple[int, int], ...]  # (start_ns, end_ns) on this rank's clock
    spent_ns: int  # all the time the replay added to the step (warm-up and timing included)


def clone_inputs(value: Any) -> Any:
    """Tensors cloned (nested in tuples, lists and dicts), anything else as is."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(clone_inputs(v) for v in value)
    if isinstance(value, list):
        return [clone_inputs(v) for v in value]
    if isinstance(value, dict):
        return {k: clone_inputs(v) for k, v in value.items()}
    return value


@dataclass
class ReplaySampler:
    """Which steps are sampled, and the replay loop.

    A step is sampled when it is the first of its shape (`step_key`: requests, prefill or
    decode), then every `every`-th step of that shape: a deterministic function of what the
    scheduler sent, so every rank of a tensor-parallel group samples the same steps and replays
    the same collectives in the same order (a rank that replayed alone would deadlock).
    `agree(n)` returns the number of calls the whole group uses (the maximum over its ranks);
    `sync` waits for queued device work (a GPU), so that it falls inside its window."""

    windows: int
    min_window_s: float
    every: int
    max_calls: int = 100_000
    layers: int = 0  # decoder layers replayed per sampled step, rotating (0: all)
    n_layers: int = 0
    agree: Callable[[int], int] = lambda n: n
    sync: Callable[[], object] = lambda: None
    seen: dict[Hashable, int] = field(default_factory=dict)
    active: bool = False  # the current step is sampled
    replaying: bool = False  # inside a replay: hooks and wrappers must not record or recurse
    sampled_steps: int = 0

    def begin_step(self, key: Hashable | None) -> bool:
        """Decide for a new step (key None: an empty step, never sampled)."""
        self.replaying = False
        if key is None:
            self.active = False
            return False
        count = self.seen.get(key, 0)
        self.seen[key] = count + 1
        self.active = count % self.every == 0
        self.sampled_steps += self.active
        return self.active

    def covers(self, layer: int | None) -> bool:
        """Whether this sampled step replays a node of decoder layer `layer` (None: outside the
        layers, always). Layers of one type are alike, so a long model replays `layers` of
        them per sampled step, the next ones on the next sampled step: the step stays short
        enough for vLLM's step timeout."""
        if layer is None or self.layers <= 0 or self.layers >= self.n_layers:
            return True
        first = (self.sampled_steps - 1) * self.layers
        return (layer - first) % self.n_layers < self.layers

    def replay(self, call: Callable[[], object]) -> ReplayWindows:
        """`call` once to warm up, then a short burst to size the windows
        (`calls_per_window`, agreed), then `windows` windows of the agreed number of calls
        (enough for `min_window_s`, at most `max_calls`). The burst is a guide (a preempted one
        makes every window short), so after each window the group agrees again: if a window
        came out short on any rank, every rank starts the windows again with proportionally
        more calls, up to `SHORT_WINDOW_RETRIES` times. That agreement is also where the group
        starts its next window together (hulls stay tight)."""
        began = now_ns()
        self.replaying = True
        try:
            call()
            self.sync()
            calls = calls_per_window(call, self.sync, self.min_window_s, self.max_calls,
                                     self.agree)
            spans: list[tuple[int, int]] = []
            retries = 0
            self.agree(0)  # the group starts the first window together
            while len(spans) < self.windows:
                self.sync()
                start = now_ns()
                for _ in range(calls):
                    call()
                self.sync()
                end = now_ns()
                spans.append((start, end))
                # Every rank holds the same `calls` and `retries`: they restart together.
                wanted = calls
                length_s = (end - start) / 1e9
                if (retries < SHORT_WINDOW_RETRIES and calls < self.max_calls
                        and length_s < self.min_window_s):
                    wanted = grown_calls(calls, length_s, self.min_window_s, self.max_calls)
                agreed = int(self.agree(wanted))
                if agreed > calls and retries < SHORT_WINDOW_RETRIES:
                    calls, spans, retries = agreed, [], retries + 1
        finally:
            self.replaying = False
        return ReplayWindows(calls, tuple(spans), now_ns() - began)
