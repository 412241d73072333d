"""Engine core: what the engine counted (step energy, outcomes, errors, step clocks), and the
step header that carries each increment once to one API server."""

from __future__ import annotations

from typing import NamedTuple

from vllm_piep.runtime.record import StepHeader
from vllm_piep.runtime.worker.steptime import STEP_TIMERS

# How often a batch without rows carries the counts anyway (/metrics is that fresh while the
# engine is busy; an idle engine sends what is left at once, `patch_notify_idle.py`).
COUNTS_EVERY_NS = 100_000_000


class Counts(NamedTuple):
    """What the engine counted, cumulative since it started (the record's header fields)."""

    step_joules: float = 0.0
    errors: int = 0
    unsent_joules: float = 0.0
    aborted_joules: float = 0.0
    after_finish_joules: float = 0.0
    warmup_joules: float = 0.0
    predicted_joules: float = 0.0
    idle_joules: float = 0.0
    fitted_joules: float = 0.0
    fallback_steps: int = 0
    audit_failures: int = 0
    steps_by_timer: tuple[int, ...] = (0,) * len(STEP_TIMERS)  # last: not a number


class EngineCounts:
    """The engine's counts and its header (module docstring). A part of `EngineAccountant`
    (`accountant.py`), which sets up the state it uses."""

    _reported: Counts

    def counts(self) -> Counts:
        """The engine's counts, cumulative."""
        return Counts(self.total_joules, self.errors, self.unsent_joules, self.aborted_joules,
                      self.after_finish_joules, self.warmup_joules, self.predicted_joules,
                      self.idle_joules, self.fitted_joules, self.fallback_steps,
                      self.audit_failures, tuple(self.steps_by_timer.values()))

    def unreported(self) -> bool:
        """Whether some count has not gone out yet (the idle flush asks)."""
        return self.counts() != self._reported

    def header(self, counts: bool = True) -> StepHeader:
        """Who predicted; with `counts`, the engine's counts since they last went out (each
        increment goes out once: the caller sends this header to one API server), else
        zeros."""
        predictor = self._predictor
        if counts:
            with self._counts_lock:
                now, before = self.counts(), self._reported
                self._reported = now
                self._counts_sent_ns = self.now_ns()
            delta = Counts(*(a - b for a, b in zip(now[:-1], before[:-1], strict=True)),
                           tuple(a - b for a, b in zip(now.steps_by_timer, before.steps_by_timer,
                                                       strict=True)))
            tracked = len(self.table)
        else:
            delta, tracked = Counts(), 0
        common = dict(engine_id=self.engine_id, step_joules=delta.step_joules,
                      errors=delta.errors, unsent_joules=delta.unsent_joules, tracked=tracked,
                      aborted_joules=delta.aborted_joules,
                      after_finish_joules=delta.after_finish_joules,
                      steps_by_timer=delta.steps_by_timer, warmup_joules=delta.warmup_joules,
                      audit_failures=delta.audit_failures,
                      carries_counts=counts, meter_note=self.meter_note,
                      meter_shared=self.meter_shared)
        splitter = self.splitter
        if splitter is not None:
            common.update(meter=self.meter_name, predicted_joules=delta.predicted_joules,
                          idle_joules=delta.idle_joules, fitted_joules=delta.fitted_joules,
                          fallback_steps=delta.fallback_steps, ratios=splitter.ratios())
        if predictor is None:
            return StepHeader(source="none", bundle_id="none", predictor_ok=False, **common)
        interval = getattr(predictor, "interval", None)
        return StepHeader(
            source=predictor.source if splitter is None else self.meter_source,
            bundle_id=predictor.bundle_id, predictor_ok=True,
            interval=None if interval is None else (interval.lower, interval.upper),
            interval_level=None if interval is None else interval.level,
            interval_coverage=None if interval is None else interval.coverage, **common)

    def counts_due(self) -> bool:
        """Sparse mode: whether the counts have not gone out for `COUNTS_EVERY_NS` (a batch
        without rows then carries the header anyway; a batch with rows always does)."""
        return self.now_ns() - self._counts_sent_ns >= COUNTS_EVERY_NS
