"""Energy from an external power log: a CSV of timestamped watts from a wall meter (Watts Up Pro,
emonPi, a smart PDU...).

The log's timestamps are seconds on the logger's clock (epoch or anything); `clock_offset_s` maps
them to this host's CLOCK_MONOTONIC: t_mono = t_log + clock_offset_s (see `align_offset`). Power
is taken as piecewise linear between samples, so energy is the trapezoid integral, with linear
interpolation where a window cuts a sample interval. The file may still be growing: `read()`
re-reads appended complete lines.
"""

from __future__ import annotations

import bisect
import csv
import math
import os
import statistics
import threading
from collections.abc import Sequence

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import Device, DeviceKind, Meter, MeterError, MeterReading

_AHEAD_S = 5.0  # a live log's samples later than now by more than this: its clock disagrees


def align_offset(log_time_of_event_s: float, monotonic_ns_of_event: int) -> float:
    """The `clock_offset_s` that maps log time to CLOCK_MONOTONIC seconds, from one event seen on
    both clocks (e.g. a load step visible in the log, stamped here with `spans.now_ns()`)."""
    return monotonic_ns_of_event / 1e9 - float(log_time_of_event_s)


class ExternalLogMeter(Meter):
    """Cumulative joules of one device (default "wall") from a CSV power log."""

    name = "external"
    source = "measured"

    def __init__(self, path: str | os.PathLike[str], clock_offset_s: float = 0.0,
                 time_column: str = "timestamp", watts_column: str = "watts",
                 device: str = "wall", kind: DeviceKind = "system") -> None:
        self.path = os.fspath(path)
        self.clock_offset_s = float(clock_offset_s)
        self.time_column = time_column
        self.watts_column = watts_column
        self.device = device
        self.kind: DeviceKind = kind
        self._lock = threading.Lock()
        self._pos = 0  # bytes consumed (complete lines only)
        self._line = 0  # lines consumed
        self._cols: tuple[int, int] | None = None
        self._t: list[float] = []  # CLOCK_MONOTONIC seconds
        self._w: list[float] = []
        self._cum: list[float] = []  # joules from the first sample to sample k
        self._start_ns: int | None = None
        self.refresh()

    @classmethod
    def available(cls) -> bool:
        return True  # needs only a file; whether it exists is checked when constructed

    @staticmethod
    def align_offset(log_time_of_event_s: float, monotonic_ns_of_event: int) -> float:
        return align_offset(log_time_of_event_s, monotonic_ns_of_event)

    def devices(self) -> Sequence[Device]:
        return [Device(self.device, self.kind)]

    # -- parsing ------------------------------------------------------------------------------
    def _err(self, line: int, what: str) -> MeterError:
        return MeterError(f"external: {self.path}, line {line}: {what}")

    def refresh(self) -> int:
        """Parse lines appended since the last call (a trailing partial line waits for its
        newline). Returns how many samples were added."""
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._pos)
                    data = f.read()
            except OSError as e:
                raise MeterError(f"external: cannot read power log {self.path}: {e}") from e
            end = data.rfind(b"\n")
            if end < 0:
                return 0
            added = 0
            for raw in data[:end + 1].split(b"\n")[:-1]:
                self._line += 1
                self._pos += len(raw) + 1
                added += self._parse_line(raw.decode("utf-8", "replace").strip("\r\ufeff "))
            self.resolution_s = (statistics.median(b - a for a, b in zip(self._t, self._t[1:]))
                                 if len(self._t) > 1 else 0.0)
            return added

    def _parse_line(self, text: str) -> int:
        n = self._line
        if not text.strip() or text.lstrip().startswith("#"):
            return 0
        row = next(csv.reader([text]))
        row = [c.strip() for c in row]
        if self._cols is None:
            missing = [c for c in (self.time_column, self.watts_column) if c not in row]
            if missing:
                raise self._err(n, f"header {row} lacks column(s) {missing}")
            self._cols = (row.index(self.time_column), row.index(self.watts_column))
            return 0
        ti, wi = self._cols
        if len(row) <= max(ti, wi) or row[ti] == "" or row[wi] == "":
            raise self._err(n, f"missing {self.time_column!r} or {self.watts_column!r} "
                               f"value in {text!r}")
        try:
            t_log, w = float(row[ti]), float(row[wi])
        except ValueError:
            raise self._err(n, f"non-numeric value in {text!r}") from None
        if not (math.isfinite(t_log) and math.isfinite(w)):
            raise self._err(n, f"non-finite value in {text!r}")
        t = t_log + self.clock_offset_s
        if self._t and t <= self._t[-1]:
            raise self._err(n, f"timestamp {t_log} is not after the previous sample's "
                               f"{self._t[-1] - self.clock_offset_s}")
        if self._t:
            self._cum.append(self._cum[-1] + (self._w[-1] + w) / 2.0 * (t - self._t[-1]))
        else:
            self._cum.append(0.0)
        self._t.append(t)
        self._w.append(w)
        return 1

    # -- integration --------------------------------------------------------------------------
    @property
    def span_ns(self) -> tuple[int, int] | None:
        """First and last sample time (CLOCK_MONOTONIC ns), or None without samples."""
        with self._lock:
            return (round(self._t[0] * 1e9), round(self._t[-1] * 1e9)) if self._t else None

    def _energy_to(self, x: float) -> float:
        """Joules from the first sample to time x (CLOCK_MONOTONIC s) within the log."""
        t, w = self._t, self._w
        k = bisect.bisect_right(t, x) - 1
        if k >= len(t) - 1:
            return self._cum[-1]
        if k < 0:
            return 0.0
        dx = x - t[k]
        wx = w[k] + (w[k + 1] - w[k]) * dx / (t[k + 1] - t[k])
        return self._cum[k] + (w[k] + wx) / 2.0 * dx

    def energy_between(self, t0_ns: int, t1_ns: int) -> float:
        """Joules between two CLOCK_MONOTONIC instants; the log must cover the window."""
        if t1_ns < t0_ns:
            raise MeterError("external: window ends before it starts")
        with self._lock:
            if len(self._t) < 2:
                raise MeterError(f"external: {self.path} holds fewer than two samples")
            a, b = t0_ns / 1e9, t1_ns / 1e9
            lo, hi = self._t[0], self._t[-1]
            eps = 1e-9 * max(1.0, abs(lo), abs(hi))  # ns rounding of the bounds
            if a < lo - eps or b > hi + eps:
                raise MeterError(
                    f"external: window [{a:.6f}, {b:.6f}] s (monotonic) is outside the log "
                    f"{self.path}, which covers [{lo:.6f}, {hi:.6f}] s after clock_offset_s="
                    f"{self.clock_offset_s}; check the offset or wait for the log to catch up")
            return self._energy_to(b) - self._energy_to(a)

    def reading_at(self, t_ns: int) -> MeterReading:
        """Cumulative joules from the log's first sample to `t_ns` (clamped to the log), for
        `window()` on an offline log."""
        with self._lock:
            if not self._t:
                raise MeterError(f"external: {self.path} holds no samples")
            return MeterReading(t_ns, {self.device: self._energy_to(t_ns / 1e9)})

    # -- live use -----------------------------------------------------------------------------
    def start(self) -> None:
        self._start_ns = now_ns()
        self.refresh()

    def read(self) -> MeterReading:
        """Joules since `start()` up to now, as far as the log has reached (a live log lags by
        up to one sample interval; time before the first sample counts as nothing)."""
        if self._start_ns is None:
            raise MeterError("external: read() before start()")
        self.refresh()
        t = now_ns()
        with self._lock:
            ahead = self._t[-1] - t / 1e9 if self._t else 0.0
            if ahead > _AHEAD_S:
                raise MeterError(
                    f"external: {self.path}: its latest sample is {ahead:.1f} s ahead of this "
                    "host's clock: the logger's clock disagrees with this host's (sync both to "
                    "NTP, or set clock_offset_s)")
            j = 0.0
            if self._t:
                a = self._start_ns / 1e9
                b = t / 1e9
                j = max(0.0, self._energy_to(b) - self._energy_to(a)) if b > a else 0.0
            return MeterReading(t, {self.device: j})
