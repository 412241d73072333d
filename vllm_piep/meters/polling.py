"""What the GPU meters (NVML, AMD SMI) share: how often a device's energy counter updates,
measured at start; the power of devices without a counter polled on a thread and integrated
by trapezoid; and their common lifecycle (`GpuCounterMeter`)."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import Meter, MeterError, MeterReading, WindowEnergy

# What the resolution detection waits with between its polls; its deadline is read on `now_ns`.
# Tests replace both (this module's attributes) by a clock they move themselves.
sleep = time.sleep


def counter_period(read: Callable[[int], int], first: dict[int, int], detect_s: float,
                   poll_s: float) -> tuple[set[int], float]:
    """Poll the devices' counters (`read(device)`, `first`: their values now) every `poll_s`
    for up to `detect_s`: the devices whose counter moved, and the median interval between its
    changes, the largest over the devices (the update period; `detect_s` for a counter that
    changed fewer than twice)."""
    last = dict(first)
    changed_at: dict[int, list[int]] = {i: [] for i in first}
    deadline = now_ns() + round(detect_s * 1e9)
    while now_ns() < deadline:
        sleep(poll_s)
        t = now_ns()
        for i in first:
            v = read(i)
            if v != last[i]:
                last[i] = v
                changed_at[i].append(t)
        if all(len(c) >= 4 for c in changed_at.values()):
            break
    periods = []
    for c in changed_at.values():
        gaps = [(b - a) / 1e9 for a, b in itertools.pairwise(c)]
        periods.append(statistics.median(gaps) if gaps else detect_s)
    return {i for i, c in changed_at.items() if c}, max(periods)


class PowerIntegral:
    """Joules per device since `start`, from `power_w(device)` polled every `interval_s` on a
    daemon thread named `thread_name`, integrated by trapezoid, the last power held until the
    reading. A failed poll stops the thread; `joules` raises it (a MeterError; anything else
    wrapped in one under `meter`'s name)."""

    def __init__(self, power_w: Callable[[int], float], interval_s: float, meter: str,
                 thread_name: str) -> None:
        self._power_w = power_w
        self.interval_s = interval_s
        self._meter = meter
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: dict[int, tuple[int, float]] = {}  # device -> (t_ns, W) of its last poll
        self._integral: dict[int, float] = {}
        self._error: MeterError | None = None

    def start(self, devices: Sequence[int]) -> None:
        t = now_ns()
        for i in devices:
            self._last[i] = (t, self._power_w(i))
            self._integral[i] = 0.0
        if devices:
            self._stop_evt.clear()
            self._thread = threading.Thread(target=self._loop, name=self._thread_name,
                                            daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        for i in self._last:
            p = self._power_w(i)
            t = now_ns()
            with self._lock:
                t0, p0 = self._last[i]
                self._integral[i] += (p0 + p) / 2.0 * (t - t0) / 1e9
                self._last[i] = (t, p)

    def _loop(self) -> None:
        while not self._stop_evt.wait(self.interval_s):
            try:
                self._poll()
            except MeterError as e:
                with self._lock:
                    self._error = e
                return
            except Exception as e:  # noqa: BLE001  (recorded, raised by joules())
                with self._lock:
                    self._error = MeterError(f"{self._meter}: sampler thread failed: "
                                             f"{type(e).__name__}: {e}")
                return

    def joules(self, t_ns: int) -> dict[int, float]:
        """Each device's joules from `start` to `t_ns`."""
        with self._lock:
            if self._error is not None:
                raise self._error
            return {i: self._integral[i] + p0 * max(0, t_ns - t0) / 1e9
                    for i, (t0, p0) in self._last.items()}

    def stop(self) -> None:
        self._stop_evt.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class GpuCounterMeter(Meter):
    """The lifecycle the NVML and AMD SMI meters share: their settings; the vendor library
    (`_close_library` shuts it down, once); the instance's GPUs found with the library shut
    down on failure; the GPUs without a working counter polled (`PowerIntegral` over
    `_power_w`); the resolution set at start; the start and read guards; stop; window. Error
    messages start with `tool`."""

    source = "measured"
    tool: str  # "nvml", "amdsmi"
    _initialised = False

    def _settings(self, poll_interval_s: float, allow_short_windows: bool, detect_s: float,
                  detect_poll_s: float) -> None:
        if poll_interval_s <= 0:
            raise MeterError(f"{self.tool}: poll_interval_s must be > 0")
        self.poll_interval_s = float(poll_interval_s)
        self.allow_short_windows = allow_short_windows
        self.detect_s = float(detect_s)
        self.detect_poll_s = float(detect_poll_s)
        self.resolution_s = self.poll_interval_s
        self._counter_gpus: list[int] = []
        self._sampled_gpus: list[int] = []
        self._polled = PowerIntegral(self._power_w, self.poll_interval_s, self.tool,
                                     f"piep-{self.tool}-sampler")
        self._started = False

    def _find_gpus(self, find: Callable[[], Any]) -> Any:
        """`find()`'s GPUs; on failure the library is shut down and a MeterError raised."""
        try:
            return find()
        except MeterError:
            self._shutdown()
            raise
        except Exception as e:
            self._shutdown()
            raise MeterError(f"{self.tool}: finding this instance's GPUs failed: "
                             f"{describe(e)}") from e

    def _power_w(self, i: int) -> float:
        raise NotImplementedError

    def _close_library(self) -> None:
        raise NotImplementedError

    def _shutdown(self) -> None:
        if self._initialised:
            self._initialised = False
            with contextlib.suppress(Exception):  # shutting down: nothing left to report
                self._close_library()

    def _check_startable(self) -> None:
        if self._started:
            raise MeterError(f"{self.tool}: meter already started")
        if not self._initialised:
            raise MeterError(f"{self.tool}: meter was stopped; create a new one")

    def _begin(self, indices: Sequence[int], counter_gpus: Sequence[int],
               resolution_s: float) -> None:
        """Starts: `counter_gpus` read by their counter (its period `resolution_s`), the rest
        of `indices` polled."""
        self._counter_gpus = [i for i in indices if i in counter_gpus]
        self._sampled_gpus = [i for i in indices if i not in counter_gpus]
        if self._sampled_gpus:
            resolution_s = max(resolution_s, self.poll_interval_s)
        self.resolution_s = resolution_s or self.poll_interval_s
        self._started = True
        self._polled.start(self._sampled_gpus)

    def _check_started(self) -> None:
        if not self._started:
            raise MeterError(f"{self.tool}: read() before start()")

    def stop(self) -> None:
        self._polled.stop()
        self._started = False
        self._shutdown()

    def window(self, start: MeterReading, end: MeterReading,
               allow_short: bool = False) -> WindowEnergy:
        return super().window(start, end, allow_short or self.allow_short_windows)
