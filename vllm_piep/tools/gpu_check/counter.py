"""The GPU's own energy counter, read on a thread of its own: when its value changes, and the
power samples NVML gives beside it. A window from one counter update to another measures the
energy between them exactly (the counter's own resolution is its update period)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Update:
    """A counter value and when it was first seen (CLOCK_MONOTONIC and wall clock, ns)."""

    t_ns: int
    wall_ns: int
    mj: int


@dataclass(frozen=True)
class Window:
    start: Update
    end: Update

    @property
    def seconds(self) -> float:
        return (self.end.t_ns - self.start.t_ns) / 1e9

    @property
    def joules(self) -> float:
        return (self.end.mj - self.start.mj) / 1000.0

    @property
    def watts(self) -> float:
        return self.joules / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class CounterPoller:
    """Polls `nvmlDeviceGetTotalEnergyConsumption` every `poll_s` (and, with `power`, the power
    reading) until stopped. `updates` holds each new value; `power` (t_ns, W) every sample."""

    nvml: Any
    handle: Any
    poll_s: float = 0.002
    power: bool = False
    updates: list[Update] = field(default_factory=list)
    samples: list[tuple[int, float]] = field(default_factory=list)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-check-counter",
                                        daemon=True)

    def __enter__(self) -> CounterPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = None
        try:
            while not self._stop.is_set():
                mj = int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
                t, wall = time.perf_counter_ns(), time.time_ns()
                if mj != last:
                    self.updates.append(Update(t, wall, mj))
                    last = mj
                if self.power:
                    self.samples.append(
                        (t, float(self.nvml.nvmlDeviceGetPowerUsage(self.handle)) / 1000.0))
                time.sleep(self.poll_s)
        except BaseException as exc:  # noqa: BLE001  (reported by the caller)
            self.error = exc

    def period_s(self) -> float | None:
        """The median time between updates seen so far."""
        gaps = sorted((b.t_ns - a.t_ns) / 1e9 for a, b in zip(self.updates, self.updates[1:],
                                                               strict=False))
        return gaps[len(gaps) // 2] if gaps else None

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"reading the energy counter failed: {self.error}")

    def _first_at(self, after_ns: int) -> Update | None:
        return next((u for u in self.updates if u.t_ns >= after_ns), None)

    def window(self, start_ns: int, min_s: float, timeout_s: float,
               keep_busy: Any = None) -> Window:
        """From the first update at or after `start_ns` to the first one at least `min_s`
        later; `keep_busy()` (the load) runs all the while, so that the device is in the same
        state from before the window opens until it closes."""
        def wait_for(after_ns: int, deadline: float, what: str) -> Update:
            while (found := self._first_at(after_ns)) is None:
                self._check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the energy counter {what}")
                if keep_busy is not None:
                    keep_busy()
                else:
                    time.sleep(self.poll_s)
            return found

        first = wait_for(start_ns, time.monotonic() + timeout_s,
                         f"did not advance in {timeout_s:g} s")
        last = wait_for(first.t_ns + int(min_s * 1e9),
                        time.monotonic() + min_s + timeout_s, "stopped advancing")
        return Window(first, last)

    def value_at_wall(self, wall_ns: int) -> int:
        """The counter as a read at this wall-clock time returned it: the last update seen
        at or before it."""
        before = [u for u in self.updates if u.wall_ns <= wall_ns]
        if not before:
            raise ValueError("no counter reading before that time")
        return before[-1].mj

    def mean_power(self, start_ns: int, end_ns: int) -> float:
        values = [w for t, w in self.samples if start_ns <= t <= end_ns]
        return sum(values) / len(values) if values else float("nan")
