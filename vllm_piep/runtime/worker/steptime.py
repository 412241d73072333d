"""Step time where the model runs: the interval from the start of `execute_model` to the end of
the step's sampling, measured by the device that runs the step. No vLLM imports.

- `HostStepClock` (CPU workers): `perf_counter_ns` around the worker's calls. CPU execution is
  synchronous, so the work is done when a call returns; the engine's own time between the two
  halves of a split step (grammar masks, the next step's scheduling) is left out.
- `CudaStepClock` (CUDA and ROCm workers): a CUDA event recorded on the current stream when
  `execute_model` starts and one when the step's last call returns. The GPU runs them in stream
  order, so with async scheduling (the next step launched before this one finishes) a step's
  start event runs only once the previous step's work is done: consecutive steps' intervals are
  disjoint and together cover the time the GPU was working on steps. Recording costs no
  synchronisation; the interval is read (`StepTime.ns`) when vLLM hands the step's output over,
  after it has waited for the sampled tokens itself.

`torch.cuda.Event` is looked up when an event is made, so tests put their stand-in for the GPU
there.

A clock's methods never raise: the worker's wrappers call them on the step's path without a
`try` (a CUDA error while making an event goes to `on_error` and leaves that step untimed; the
engine core then times it itself, counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

HOST_TIMER = "perf_counter"
CUDA_TIMER = "cuda_event"
ENGINE_CLOCK = "engine_clock"  # the engine core's fallback when no worker time arrived
STEP_TIMERS = (CUDA_TIMER, HOST_TIMER, ENGINE_CLOCK)


class StepTime(Protocol):
    timer: str

    def ns(self) -> int:
        """The step's duration in ns (may wait for the step's own remaining GPU work)."""
        ...


class HostStepTime:
    __slots__ = ("_ns",)
    timer = HOST_TIMER

    def __init__(self, ns: int) -> None:
        self._ns = ns

    def ns(self) -> int:
        return self._ns


class CudaStepTime:
    """A step's start and end events. `ns()` reads their interval; when the end event has not
    run yet it waits for it: that is the rest of this step's own work (postprocessing, a
    speculative drafter) queued before the step's last call returned, never a later step's.
    `waited` says whether it had to."""

    __slots__ = ("_start", "_end", "_ns", "waited")
    timer = CUDA_TIMER

    def __init__(self, start: Any, end: Any) -> None:
        self._start, self._end = start, end
        self._ns: int | None = None
        self.waited = False

    def ns(self) -> int:
        if self._ns is None:
            if not self._end.query():
                self.waited = True
                self._end.synchronize()
            self._ns = int(round(self._start.elapsed_time(self._end) * 1e6))  # ms -> ns
            self._start = self._end = None  # the events can go
        return self._ns


class HostStepClock:
    """The worker's calls of one step, timed on the host and summed."""

    timer = HOST_TIMER

    def __init__(self) -> None:
        self._open = False
        self._since: int | None = None
        self._total = 0

    def begin(self) -> None:
        self._open, self._total = True, 0
        self._since = time.perf_counter_ns()

    def pause(self) -> None:
        if self._since is not None:
            self._total += time.perf_counter_ns() - self._since
            self._since = None

    def resume(self) -> bool:
        """False when no step is open (`sample_tokens` without `execute_model`)."""
        if self._open:
            self._since = time.perf_counter_ns()
        return self._open

    def end(self) -> HostStepTime | None:
        if not self._open:
            return None
        self.pause()
        self._open = False
        return HostStepTime(self._total)


class CudaStepClock:
    """One CUDA event at the step's start, one at its end, on the current stream."""

    timer = CUDA_TIMER

    def __init__(self, on_error: Callable[[BaseException], None] = lambda exc: None) -> None:
        self._start: Any = None
        self._open = False
        self._on_error = on_error

    @staticmethod
    def _event() -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        try:
            self._start = self._event()
            self._open = True
        except Exception as exc:  # boundary: never break a step
            self._start, self._open = None, False
            self._on_error(exc)

    def pause(self) -> None:
        pass  # the GPU interval runs on: the events bracket the whole step

    def resume(self) -> bool:
        return self._open

    def end(self) -> CudaStepTime | None:
        if not self._open:
            return None
        self._open = False
        start, self._start = self._start, None
        try:
            return CudaStepTime(start, self._event())
        except Exception as exc:  # boundary: never break a step
            self._on_error(exc)
            return None


class NoStepClock:
    """A worker whose clock could not be made: its steps go untimed."""

    timer = ENGINE_CLOCK

    def begin(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def resume(self) -> bool:
        return False

    def end(self) -> None:
        return None


StepClock = HostStepClock | CudaStepClock | NoStepClock


def step_clock(device_type: str, on_error: Callable[[BaseException], None] = lambda exc: None
               ) -> StepClock:
    """CUDA events on CUDA and ROCm devices (torch calls both "cuda"), host time elsewhere."""
    return CudaStepClock(on_error) if device_type == "cuda" else HostStepClock()
