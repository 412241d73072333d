"""What the GPU meters (NVML, AMD SMI) share: how often a device's energy counter updates,
measured at start, and the power of devices without a counter polled on a thread and integrated
by trapezoid."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable, Sequence

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import MeterError


def counter_period(read: Callable[[int], int], first: dict[int, int], detect_s: float,
                   poll_s: float) -> tuple[set[int], float]:
    """Poll the devices' counters (`read(device)`, `first`: their values now) every `poll_s`
    for up to `detect_s`: the devices whose counter moved, and the median interval between its
    changes, the largest over the devices (the update period; `detect_s` for a counter that
    changed fewer than twice)."""
    last = dict(first)
    changed_at: dict[int, list[int]] = {i: [] for i in first}
    deadline = time.perf_counter() + detect_s
    while time.perf_counter() < deadline:
        time.sleep(poll_s)
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
