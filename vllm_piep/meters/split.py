"""Measured energy split among engine steps: the meter decides the total, the model the split.

A meter gives cumulative joules at its readings; an engine gives steps, each with its time span
and its predicted energy (static and dynamic parts). `IntervalSplitter` turns each interval
between two readings into energy per step:

    weight(step) = predicted(step) x (the step's time inside the interval / the step's time)
    weight(idle) = idle_watts x (the interval's time no step covers)
    measured(step) += E_interval x weight(step) / sum of the weights

so that, over the settled intervals, the steps' measured energy plus the idle energy equals the
meter's delta exactly. A step is settled once a reading at or after its end has been split (its
time is then wholly covered). Readings are split only up to the time the engine's steps are
known (`known_until_ns`): a reading taken while a step runs waits for that step.

A reading lower than the last (a driver reset) or a meter that fails leaves the steps of that
interval unmeasured: `fallback()` settles them by the online fit instead and the meter is
re-based at its next reading (the energy between is not attributed; `gap_seconds` counts it).
A reading may say how much of its cumulative joules is an estimate (`fitted`: a meter made of
several whose one part failed estimates that part from the others): each step of an interval
takes that fraction of its share as estimated (`estimated_j`), and so does the idle energy
(`Settled.estimated_j` counts both).

The online fit: measured ~ a x static + b x dynamic over the settled intervals, exponentially
weighted (half-life `fit_half_life` intervals), ridge-pulled towards (1, 1): `ratios()` gives
(a, b), the measured/predicted ratios of the two component groups, and settles fallback steps.
No vLLM imports.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

_RIDGE = 1e-6  # relative pull of the fit towards (1, 1) when an interval says little


@dataclass(slots=True)
class PendingStep:
    t0_ns: int
    t1_ns: int
    static_j: float
    dynamic_j: float
    payload: Any = None  # the caller's: what to scale once the step is settled
    measured_j: float = 0.0
    fitted_j: float = 0.0  # of measured_j: the part settled by the fit
    estimated_j: float = 0.0  # of measured_j: the part of readings that were estimates
    covered: float = 0.0  # the fraction of its time split so far
    fallback: bool = False  # settled by the fit, not the meter

    @property
    def unmeasured(self) -> float:
        """The fraction of the step the meter did not measure: 1 for a step settled by the
        fit, else the estimated part of its energy (0 for a step wholly measured)."""
        if self.fallback:
            return 1.0
        if self.estimated_j <= 0.0:
            return 0.0
        return min(1.0, self.estimated_j / self.measured_j)

    @property
    def predicted_j(self) -> float:
        return self.static_j + self.dynamic_j

    @property
    def ratio(self) -> float:
        """Measured over predicted (1 for a step predicted to cost nothing)."""
        return self.measured_j / self.predicted_j if self.predicted_j > 0 else 1.0


@dataclass
class Settled:
    """What one `settle()` call settled."""

    steps: list[PendingStep] = field(default_factory=list)
    idle_j: float = 0.0
    measured_j: float = 0.0  # the meter's delta over the intervals split (steps + idle)
    estimated_j: float = 0.0  # of it, the readings' estimates (steps + idle)


class IntervalSplitter:
    def __init__(self, idle_watts: float, fit_half_life: float = 200.0) -> None:
        if idle_watts < 0 or not math.isfinite(idle_watts):
            raise ValueError(f"idle_watts must be finite and >= 0, got {idle_watts}")
        self.idle_watts = float(idle_watts)
        self._decay = 0.5 ** (1.0 / fit_half_life)
        self.pending: deque[PendingStep] = deque()
        self._readings: deque[tuple[int, float, float]] = deque()
        # The last reading split (or the base): time, joules, estimated joules.
        self._last: tuple[int, float, float] | None = None
        self.gap_seconds = 0.0
        # Exponentially weighted normal equations of E = a S + b D.
        self._sss = self._ssd = self._sdd = self._sse = self._sde = 0.0

    # -- input --------------------------------------------------------------------------------
    def add_step(self, step: PendingStep) -> None:
        self.pending.append(step)

    def add_reading(self, t_ns: int, joules: float, fitted: float = 0.0) -> None:
        """A cumulative reading, `fitted` joules of it estimated (cumulative too); any thread
        may call it, `settle` consumes it."""
        self._readings.append((t_ns, joules, fitted))

    @property
    def based(self) -> bool:
        return self._last is not None

    @property
    def readings_waiting(self) -> bool:
        """Whether a reading waits to be split (`settle` has something to do)."""
        return bool(self._readings)

    # -- settling -----------------------------------------------------------------------------
    def settle(self, known_until_ns: int) -> Settled:
        """Split every queued reading taken by `known_until_ns`; return the steps now settled,
        in order, and the idle energy of those intervals."""
        out = Settled()
        while self._readings and self._readings[0][0] <= known_until_ns:
            t_ns, joules, fitted = self._readings.popleft()
            last = self._last
            if last is None or t_ns <= last[0]:
                if last is None:
                    self._last = (t_ns, joules, fitted)
                    self._unmeasured_before(t_ns, out)
                continue
            if joules < last[1] or not math.isfinite(joules):
                self._rebase(t_ns, joules, fitted, out)
                continue
            energy = joules - last[1]
            estimated = min(energy, max(0.0, fitted - last[2]))
            self._split(last[0], t_ns, energy, out, estimated / energy if energy > 0 else 0.0)
            self._last = (t_ns, joules, fitted)
            while self.pending and self.pending[0].t1_ns <= t_ns:
                out.steps.append(self.pending.popleft())
        return out

    def _split(self, ta: int, tb: int, energy: float, out: Settled,
               estimated: float = 0.0) -> None:
        """`energy` over the steps and idle time of (ta, tb]; `estimated`: the fraction of it
        that is an estimate, not a reading."""
        span = (tb - ta) / 1e9
        overlaps: list[tuple[PendingStep, float]] = []
        covered_s = 0.0
        for step in self.pending:
            if step.t0_ns > tb:  # steps come in order
                break
            length = step.t1_ns - step.t0_ns
            if length <= 0:  # an instant step belongs to the interval that holds its end
                part = 1.0 if ta < step.t1_ns <= tb else 0.0
            else:
                inside = min(step.t1_ns, tb) - max(step.t0_ns, ta)
                part = max(0.0, inside / length)
                covered_s += max(0, inside) / 1e9
            if part > 0.0:
                overlaps.append((step, part))
        idle_s = max(0.0, span - covered_s)
        weights = [step.predicted_j * part for step, part in overlaps]
        idle_w = self.idle_watts * idle_s
        total_w = math.fsum(weights) + idle_w
        static = math.fsum(s.static_j * p for s, p in overlaps) + idle_w
        dynamic = math.fsum(s.dynamic_j * p for s, p in overlaps)
        self._fit(static, dynamic, energy)
        out.measured_j += energy
        out.estimated_j += energy * estimated
        if total_w <= 0.0:
            out.idle_j += energy
            for step, part in overlaps:
                step.covered += part
            return
        given = 0.0
        for (step, part), weight in zip(overlaps, weights, strict=True):
            share = energy * weight / total_w
            step.measured_j += share
            step.estimated_j += share * estimated
            step.covered += part
            given += share
        out.idle_j += energy - given  # the idle share, and the rounding: exact in the sum

    def _unmeasured_before(self, t_ns: int, out: Settled) -> None:
        """Steps that ended before the meter's first reading (or a re-base) are not measured."""
        while self.pending and self.pending[0].t1_ns <= t_ns:
            step = self.pending.popleft()
            self._settle_by_fit(step)
            out.steps.append(step)
        for step in self.pending:  # a step the base cuts: its part before it goes by the fit
            if step.t0_ns < t_ns < step.t1_ns:
                before = (t_ns - step.t0_ns) / (step.t1_ns - step.t0_ns)
                self._fit_part(step, max(0.0, before - step.covered))

    def _rebase(self, t_ns: int, joules: float, fitted: float, out: Settled) -> None:
        last = self._last
        if last is not None:
            self.gap_seconds += (t_ns - last[0]) / 1e9
        self._last = (t_ns, joules, fitted) if math.isfinite(joules) else None
        self._unmeasured_before(t_ns, out)

    def fallback(self, until_ns: int) -> Settled:
        """The meter cannot speak for the steps that ended by `until_ns` (it failed, stalled or
        went back): settle them by the fit, drop the readings so far, re-base at the next."""
        out = Settled()
        self._readings.clear()
        last = self._last
        if last is not None:
            self.gap_seconds += max(0, until_ns - last[0]) / 1e9
        self._last = None
        while self.pending and self.pending[0].t1_ns <= until_ns:
            step = self.pending.popleft()
            self._settle_by_fit(step)
            out.steps.append(step)
        return out

    def _settle_by_fit(self, step: PendingStep) -> None:
        self._fit_part(step, max(0.0, 1.0 - step.covered))

    def _fit_part(self, step: PendingStep, part: float) -> None:
        if part <= 0.0:
            return
        a, b = self.ratios()
        fitted = part * (a * step.static_j + b * step.dynamic_j)
        step.measured_j += fitted
        step.fitted_j += fitted
        step.covered += part
        step.fallback = True

    # -- the online fit -----------------------------------------------------------------------
    def _fit(self, static: float, dynamic: float, energy: float) -> None:
        d = self._decay
        self._sss = d * self._sss + static * static
        self._ssd = d * self._ssd + static * dynamic
        self._sdd = d * self._sdd + dynamic * dynamic
        self._sse = d * self._sse + static * energy
        self._sde = d * self._sde + dynamic * energy

    def ratios(self) -> tuple[float, float]:
        """(static, dynamic) measured/predicted ratios of the fit; (1, 1) before any data."""
        scale = max(self._sss, self._sdd, 1e-300)
        lam = _RIDGE * scale
        # Ridge towards (1, 1): minimise |E - aS - bD|^2 + lam ((a-1)^2 + (b-1)^2).
        m11, m12, m22 = self._sss + lam, self._ssd, self._sdd + lam
        r1, r2 = self._sse + lam, self._sde + lam
        det = m11 * m22 - m12 * m12
        if det <= 0.0 or not math.isfinite(det):
            return 1.0, 1.0
        a = (r1 * m22 - r2 * m12) / det
        b = (m11 * r2 - m12 * r1) / det
        if a < 0.0 or b < 0.0:  # collinear parts: one common ratio
            common = (self._sse + self._sde) / max(self._sss + 2 * self._ssd + self._sdd,
                                                   1e-300)
            return (common, common) if common > 0 else (1.0, 1.0)
        return a, b
