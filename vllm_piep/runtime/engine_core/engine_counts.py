"""Engine core: what the engine counted (step energy, outcomes, errors, step clocks), and the
step header that carries each increment once to one API server (`Reports`, `step_header`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from operator import sub
from typing import Any, NamedTuple

from msgspec.structs import replace

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
    estimated_joules: float = 0.0
    audit_failures: int = 0
    zero_time_steps: int = 0
    steps_by_timer: tuple[int, ...] = (0,) * len(STEP_TIMERS)  # last: not a number


class Reports:
    """What went out to the API servers: each increment of the counts goes out once, to one
    of them (the lock lets the engine's idle flush and its step loop take them without sending
    one twice), and when."""

    def __init__(self, clock_ns: Callable[[], int]) -> None:
        self._clock_ns = clock_ns
        self._reported = Counts()
        self._lock = threading.Lock()
        self._sent_ns = 0
        self.client = 0  # the API server client the counts last went to

    def unreported(self, now: Counts) -> bool:
        """Whether some count has not gone out yet (the idle flush asks)."""
        return now != self._reported

    def take(self, now: Counts) -> Counts:
        """The increments since the counts last went out, which go out now."""
        with self._lock:
            before, self._reported = self._reported, now
            self._sent_ns = self._clock_ns()
        return Counts(*map(sub, now[:-1], before[:-1]),
                      tuple(map(sub, now.steps_by_timer, before.steps_by_timer)))

    def due(self) -> bool:
        """Whether the counts have not gone out for `COUNTS_EVERY_NS` (a batch without rows
        then carries them anyway; a batch with rows always does)."""
        return self._clock_ns() - self._sent_ns >= COUNTS_EVERY_NS


def with_counts(plain: StepHeader, delta: Counts, tracked: int) -> StepHeader:
    """`plain` (a header of no counts, `step_header(Counts(), False, ...)`) carrying the
    increments `delta`: what `step_header` makes of them, from the fields that change alone
    (measured mode's own counts only in measured mode)."""
    measured = {} if plain.meter is None else dict(
        predicted_joules=delta.predicted_joules, idle_joules=delta.idle_joules,
        fitted_joules=delta.fitted_joules, fallback_steps=delta.fallback_steps,
        estimated_joules=delta.estimated_joules)
    return replace(plain, step_joules=delta.step_joules, errors=delta.errors,
                   unsent_joules=delta.unsent_joules, tracked=tracked,
                   after_finish_joules=delta.after_finish_joules,
                   aborted_joules=delta.aborted_joules, steps_by_timer=delta.steps_by_timer,
                   warmup_joules=delta.warmup_joules, carries_counts=True,
                   audit_failures=delta.audit_failures, zero_time_steps=delta.zero_time_steps,
                   **measured)


def step_header(delta: Counts, carries: bool, tracked: int, engine_id: str,
                predictor: Any, settler: Any, meter_note: str | None,
                meter_shared: int) -> StepHeader:
    """Who predicted (`predictor`, None: none loaded), in which mode (`settler`), and the
    counts' increments `delta` where this header `carries` them."""
    if settler.measured:
        measured = dict(meter=settler.meter_name, predicted_joules=delta.predicted_joules,
                        idle_joules=delta.idle_joules, fitted_joules=delta.fitted_joules,
                        fallback_steps=delta.fallback_steps,
                        estimated_joules=delta.estimated_joules,
                        ratios=settler.splitter.ratios())
        source = settler.source
    else:
        measured, source = {}, None
    if predictor is None:
        source, bundle_id, interval, ok = "none", "none", None, False
    else:
        source = source or predictor.source
        bundle_id, interval, ok = predictor.bundle_id, getattr(predictor, "interval", None), True
    return StepHeader(
        source=source, bundle_id=bundle_id, engine_id=engine_id,
        step_joules=delta.step_joules, errors=delta.errors, predictor_ok=ok,
        unsent_joules=delta.unsent_joules, tracked=tracked,
        interval=None if interval is None else (interval.lower, interval.upper),
        interval_level=None if interval is None else interval.level,
        interval_coverage=None if interval is None else interval.coverage,
        after_finish_joules=delta.after_finish_joules, aborted_joules=delta.aborted_joules,
        steps_by_timer=delta.steps_by_timer, warmup_joules=delta.warmup_joules,
        carries_counts=carries, meter_note=meter_note, meter_shared=meter_shared,
        audit_failures=delta.audit_failures, zero_time_steps=delta.zero_time_steps,
        **measured)
