"""Energy of time windows: of recorded spans, from a meter's readings, and PIE-P's repeated
sampling (paper Appendix L): run one module or collective many times back to back inside one
meter window that is long enough for the meter's resolution, and report energy per call with its
spread over several such windows. No vLLM imports: the campaign calls `repeated_sampling` inside
vLLM workers with the module's forward (or the collective) as `call`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from vllm_piep.meters.common import (
    SHORT_WINDOW_RETRIES,
    Meter,
    MeterError,
    MeterReading,
    calls_per_window,
    grown_calls,
)


def span_energy(spans: pd.DataFrame, readings: Sequence[MeterReading], meter: Meter,
                start: str = "start_ns", end: str = "end_ns") -> pd.DataFrame:
    """Joules of each span's window per device (one column per device, plus `total`), from
    `meter`'s cumulative readings interpolated linearly between their timestamps. Columns
    added: `covered` (the readings span the window: otherwise NaN), `resolved` (the window is at
    least the meter's resolution: shorter windows are an approximation), and `meter` and
    `source` (measured, estimated or simulated), so that an estimate stays labelled."""
    resolution_s = meter.resolution_s
    if len(readings) < 2:
        raise MeterError("span energy needs at least two meter readings")
    t = np.array([r.t_ns for r in readings], dtype=np.float64)
    if np.any(np.diff(t) < 0):
        raise MeterError("meter readings are not in time order")
    devices = list(readings[0].joules)
    a = spans[start].to_numpy(dtype=np.float64)
    b = spans[end].to_numpy(dtype=np.float64)
    covered = (a >= t[0]) & (b <= t[-1]) & (b >= a)
    out = pd.DataFrame(index=spans.index)
    total = np.zeros(len(spans))
    for device in devices:
        cum = np.array([r.joules[device] for r in readings], dtype=np.float64)
        joules = np.interp(b, t, cum) - np.interp(a, t, cum)
        joules[~covered] = np.nan
        out[device] = joules
        total = total + joules
    out["total"] = total
    out["covered"] = covered
    out["resolved"] = (b - a) / 1e9 >= resolution_s
    out["meter"] = meter.name
    out["source"] = meter.source
    return out


@dataclass(frozen=True)
class RepeatedEnergy:
    """Energy per call from repeated sampling, over `windows` meter windows of `calls` calls."""

    joules_per_call: float  # mean over windows
    std_joules: float  # spread of the per-call energy across windows
    seconds_per_call: float
    calls: int  # per window
    windows: int
    window_s: float  # mean window length
    per_window_joules: tuple[float, ...]  # per call, each window
    meter: str
    source: str
    baseline_watts: float  # subtracted power (0 when none was given)

    @property
    def relative_spread(self) -> float:
        return self.std_joules / self.joules_per_call if self.joules_per_call else math.inf


def repeated_sampling(call: Callable[[], object], meter: Meter, *, windows: int = 5,
                      min_window_s: float | None = None, max_calls: int = 1_000_000,
                      warmup: int = 3, sync: Callable[[], object] | None = None,
                      baseline_watts: float = 0.0) -> RepeatedEnergy:
    """Measures `call`'s energy with a meter too coarse for one call (PIE-P Appendix L).

    The number of calls per window is chosen so that a window lasts at least `min_window_s`
    (default: ten times the meter's resolution, and at least 50 ms); `sync` (e.g.
    `torch.cuda.synchronize`) runs before each reading so that queued device work is inside
    its window. `baseline_watts` (idle power measured beforehand) is subtracted, so that the
    result is the energy the calls add. The meter must be started."""
    if windows < 2:
        raise ValueError("repeated sampling needs at least 2 windows to report a spread")
    done = sync or (lambda: None)
    for _ in range(warmup):
        call()
    done()
    target = min_window_s if min_window_s is not None else max(10 * meter.resolution_s, 0.05)
    calls = calls_per_window(call, done, target, max_calls)
    # The burst that sized the windows is a guide (a preempted one makes windows short), so a
    # window that comes out shorter than the target starts the windows again with more calls.
    for attempt in range(SHORT_WINDOW_RETRIES + 1):
        per_call: list[float] = []
        lengths: list[float] = []
        for _ in range(windows):
            done()
            start = meter.read()
            for _ in range(calls):
                call()
            done()
            end = meter.read()
            can_retry = attempt < SHORT_WINDOW_RETRIES and calls < max_calls
            energy = meter.window(start, end, allow_short=can_retry)
            per_call.append((energy.total - baseline_watts * energy.seconds) / calls)
            lengths.append(energy.seconds)
            if can_retry and energy.seconds < target:
                calls = grown_calls(calls, energy.seconds, target, max_calls)
                break
        else:
            break
    return RepeatedEnergy(
        joules_per_call=statistics.fmean(per_call), std_joules=statistics.stdev(per_call),
        seconds_per_call=statistics.fmean(lengths) / calls, calls=calls, windows=windows,
        window_s=statistics.fmean(lengths), per_window_joules=tuple(per_call),
        meter=meter.name, source=meter.source, baseline_watts=baseline_watts)
