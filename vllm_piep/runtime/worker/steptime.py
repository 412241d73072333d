"""Step time where the model runs: the interval from the start of `execute_model` to the end of
the step's sampling, measured by the device that runs the step. No vLLM imports.

- `HostStepClock` (CPU workers): `perf_counter_ns` around the worker's calls. CPU execution is
  synchronous, so the work is done when a call returns; the engine's own time between the two
  halves of a split step (grammar masks, the next step's scheduling) is left out.
- `CudaStepClock` (CUDA and ROCm workers): a CUDA event recorded on the worker's stream when
  `execute_model` starts and one when the step's last call returns. The GPU runs them in stream
  order, so with async scheduling (the next step launched before this one finishes) a step's
  start event runs only once the previous step's work is done: consecutive steps' intervals are
  disjoint and together cover the time the GPU was working on steps. Recording costs no
  synchronisation; the interval is read (`StepTime.ns`) after vLLM has waited for the step's
  sampled tokens itself: by the engine core off its loop, or where the output is pickled.

`torch.cuda.Event` and `torch.cuda.current_stream` are looked up when first needed, so tests put
their stand-in for the GPU there.

A clock's methods never raise: the worker's wrappers call them on the step's path without a
`try` (a CUDA error while recording an event goes to `on_error` and leaves that step untimed;
the engine core then times it itself, counted).
"""

from __future__ import annotations

import threading
import time
from collections import deque
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


class KnownStepTime:
    """A duration already known: a host-timed step, or a GPU-timed one read before it was
    pickled to another process (only numbers cross: see `CudaStepTime.__reduce__`)."""

    __slots__ = ("_ns", "timer")

    def __init__(self, ns: int, timer: str) -> None:
        self._ns, self.timer = ns, timer

    def ns(self) -> int:
        return self._ns

    def __reduce__(self) -> tuple[Any, ...]:
        return KnownStepTime, (self._ns, self.timer)


def _untimed() -> None:
    """What a step time whose events failed unpickles as: none (the engine times the step)."""
    return None


class EventPool(deque):  # type: ignore[type-arg]
    """A clock's idle CUDA events. Only the worker's thread takes one (a plain `pop`, on the
    loop); a step's events come back once it is read, on whichever thread reads it, under
    `lock`: the engine core, the span writer and the pickling of the output may read the same
    step, and an event given back twice would be recorded by two steps at once."""

    def __init__(self, maxlen: int,
                 on_error: Callable[[BaseException], None] = lambda exc: None) -> None:
        super().__init__(maxlen=maxlen)
        self.lock = threading.Lock()
        self.on_error = on_error  # the clock's: for a step whose events fail when read


class CudaStepTime:
    """A step's start and end events. `ns()` reads their interval; when the end event has not
    run yet it waits for it: that is the rest of this step's own work (postprocessing, a
    speculative drafter) queued before the step's last call returned, never a later step's.
    `waited` says whether it had to. Once read, the events go back to their clock's pool.

    The engine core reads it off its loop (`read_step_time`); pickled to the engine core by
    another process it is read first, there, and goes as a `KnownStepTime`."""

    __slots__ = ("_start", "_end", "_ns", "_pool", "waited")
    timer = CUDA_TIMER

    def __init__(self, start: Any, end: Any, pool: EventPool) -> None:
        self._start, self._end, self._pool = start, end, pool
        self._ns: int | None = None
        self.waited = False

    def ns(self) -> int:
        ns = self._ns
        if ns is None:
            with self._pool.lock:
                ns = self._ns if self._ns is not None else self._read()
        return ns

    def _read(self) -> int:
        start, end = self._start, self._end
        if not end.query():
            self.waited = True
            end.synchronize()
        self._ns = ns = int(round(start.elapsed_time(end) * 1e6))  # ms -> ns
        self._start = self._end = None
        self._pool.append(start)  # both completed: they can be recorded again
        self._pool.append(end)
        return ns

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            return KnownStepTime, (self.ns(), CUDA_TIMER)
        except Exception as exc:  # boundary: vLLM is pickling the step's output
            self._pool.on_error(exc)
            return _untimed, ()


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

    def end(self) -> KnownStepTime | None:
        if not self._open:
            return None
        self.pause()
        self._open = False
        return KnownStepTime(self._total, HOST_TIMER)


class CudaStepClock:
    """One CUDA event at the step's start, one at its end, on the worker's stream.

    Both are on the engine loop's critical path when the worker runs inside the engine core, so
    neither makes an object per step: events come from a pool (those of steps already read), and
    the stream is looked up once, at the first step. vLLM's model runner V2 caches its stream
    the same way (`GPUModelRunner.main_stream`), and vLLM's `current_stream` says why:
    `torch.cuda.current_stream()` makes a new stream object at each call."""

    timer = CUDA_TIMER
    POOL = 64  # idle events kept; steps in flight at once are a handful

    def __init__(self, on_error: Callable[[BaseException], None] = lambda exc: None) -> None:
        self._start: Any = None
        self._open = False
        self._on_error = on_error
        self._stream: Any = None
        self._idle = EventPool(self.POOL, on_error)

    def _new_event(self) -> Any:
        """An event when the pool has none (and, at the first, the worker's stream)."""
        import torch

        if self._stream is None:
            self._stream = torch.cuda.current_stream()
        return torch.cuda.Event(enable_timing=True)

    def begin(self) -> None:
        try:
            start = self._idle.pop() if self._idle else self._new_event()
            start.record(self._stream)
            self._start, self._open = start, True
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
            end = self._idle.pop() if self._idle else self._new_event()
            end.record(self._stream)
            return CudaStepTime(start, end, self._idle)
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
