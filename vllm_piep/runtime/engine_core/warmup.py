"""One-off work inside a request's step (first-use compilation, CUDA-graph capture, lazy kernel
loads, the first use of a feature such as logprobs) is not the request's cost.

The rule: a step took warm-up time when it lasted more than `factor` (10) times what the engine's
own recent steps say it should, and more than `floor_s` (0.1 s) longer. What it should take is
the larger of the median duration of the last `history` (64) steps and the time its tokens take
at the fastest token rate those steps reached (so a long prefill is compared with the engine's
best throughput, never with a one-token decode step). The excess over that expectation is the
warm-up time; the step's static energy over it goes to the `warmup` outcome, not to the step's
requests.

The judgement needs `min_history` (8) steps; the engine's first steps are judged once that many
have run, against all of them (the median and the best rate shrug off one slow step), and their
warm-up energy is taken back from the requests that ran in them if those are still in flight.
A request that finished before its step could be judged keeps it (a first request of one or two
steps on a fresh server).
"""

from __future__ import annotations

import statistics
from collections import deque


class WarmupDetector:
    def __init__(self, factor: float = 10.0, floor_s: float = 0.1, history: int = 64,
                 min_history: int = 8) -> None:
        self.factor = factor
        self.floor_s = floor_s
        self.min_history = min_history
        # Each step's seconds and tokens per second (0 for a step of no time), apart: the
        # median and the maximum are then C-level calls (this runs every step).
        self._seconds: deque[float] = deque(maxlen=history)
        self._rates: deque[float] = deque(maxlen=history)
        # Whether `min_history` steps were observed: an attribute, read every step.
        self.ready = min_history <= 0

    def expected_s(self, tokens: float) -> float:
        median = statistics.median(self._seconds)
        best_rate = max(self._rates) if self._rates else 0.0
        return max(median, tokens / best_rate if best_rate > 0 else 0.0)

    def excess_s(self, tokens: float, seconds: float) -> float:
        """The warm-up time in a step (0: none), once `ready`."""
        if seconds <= self.floor_s:  # cannot exceed any expectation by the floor: no median
            return 0.0
        expected = self.expected_s(tokens)
        if seconds > self.factor * expected and seconds - expected > self.floor_s:
            return seconds - expected
        return 0.0

    def observe(self, tokens: float, seconds: float) -> None:
        """A step the history learns from: a judged step with its warm-up time taken out; the
        first steps, before they can be judged, as they were (the median and the best rate
        shrug off a slow one)."""
        self._seconds.append(seconds)
        self._rates.append(tokens / seconds if seconds > 0 else 0.0)
        if not self.ready:
            self.ready = len(self._seconds) >= self.min_history
