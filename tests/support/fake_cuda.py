"""A stand-in for CUDA's stream and events (`torch.cuda.Event(enable_timing=True)`,
`torch.cuda.current_stream()`): work launched on the simulated stream runs in order; an event
completes when the work enqueued before it is done (at once on an idle stream); `elapsed_time`
is the simulated GPU time between two events, in ms as CUDA gives it. Each recorded event's
completion time goes to the JSON lines file FAKE_GPU_LOG names, when set.

The stream's time is its `clock`: wall time by default (`WallClock`: a server's stand-in GPU
takes as long as the work it simulates), or a `ManualClock` that moves only when a test moves
it or the host waits for the stream, so that what a test asserts of GPU time does not depend
on how fast this machine runs the test."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch


def log(record: dict) -> None:
    path = os.environ.get("FAKE_GPU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


class WallClock:
    """The stream's time is this machine's (`perf_counter_ns`); waiting for it sleeps."""

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    @staticmethod
    def wait_until(ns: int) -> None:
        wait = ns - time.perf_counter_ns()
        if wait > 0:
            time.sleep(wait / 1e9)


class ManualClock:
    """The stream's time stands still but when a test moves it (`advance`) or the host waits
    for the stream (`wait_until`: at once, the clock moved to then)."""

    def __init__(self, start_ns: int = 1_000_000_000) -> None:
        self.t = start_ns

    def now(self) -> int:
        return self.t

    def advance(self, ns: int) -> None:
        self.t += ns

    def wait_until(self, ns: int) -> None:
        self.t = max(self.t, ns)


class FakeStream:
    """One CUDA stream: work runs in launch order; `tail_ns` is when all of it is done."""

    def __init__(self, clock: WallClock | ManualClock | None = None) -> None:
        self.clock = clock or WallClock()
        self.tail_ns = 0
        self.held_from_ns: int | None = None  # held work starts here; it runs once waited on
        self.lock = threading.Lock()

    def launch(self, duration_ns: int, held: bool = False) -> int:
        with self.lock:
            start = max(self.clock.now(), self.tail_ns)
            if held and self.held_from_ns is None:
                self.held_from_ns = start
            self.tail_ns = start + duration_ns
            return self.tail_ns

    def pending(self, done_ns: int) -> bool:
        """Whether an event completing at `done_ns` waits behind held work."""
        return self.held_from_ns is not None and done_ns > self.held_from_ns

    def release(self) -> None:
        """The host waits: held work runs, in simulated time, from where it was launched."""
        with self.lock:
            self.held_from_ns = None

    def point(self) -> int:
        """When an event recorded now completes: at once on an idle stream, else when the work
        before it is done."""
        with self.lock:
            self.tail_ns = max(self.clock.now(), self.tail_ns)
            return self.tail_ns


STREAM = FakeStream()


class FakeCudaEvent:
    """`torch.cuda.Event(enable_timing=True)` on the simulated stream."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.done_ns: int | None = None

    def record(self, stream: Any = None) -> None:
        self.done_ns = STREAM.point()
        log({"event": self.done_ns})

    def query(self) -> bool:
        return (self.done_ns is not None and not STREAM.pending(self.done_ns)
                and STREAM.clock.now() >= self.done_ns)

    def synchronize(self) -> None:
        if self.done_ns is not None:
            if STREAM.pending(self.done_ns):
                STREAM.release()
            STREAM.clock.wait_until(self.done_ns)

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        assert self.done_ns is not None and end.done_ns is not None, "events not recorded"
        assert self.query() and end.query(), "elapsed_time on events that have not completed"
        return (end.done_ns - self.done_ns) / 1e6  # ms, as CUDA gives it


def install_fake_cuda_events() -> None:
    torch.cuda.Event = FakeCudaEvent  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda device=None: STREAM  # type: ignore[assignment]


