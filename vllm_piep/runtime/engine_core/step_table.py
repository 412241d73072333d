"""Engine core: the steps scheduled and not yet done, and the time of each step done, counted by
the clock that gave it (`StepTable`). No vLLM imports."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from vllm_piep.once import logger
from vllm_piep.runtime.engine_core.releases import MAX_PENDING_STEPS
from vllm_piep.runtime.engine_core.scheduled import RawStep, ScheduledStep
from vllm_piep.runtime.worker.steptime import ENGINE_CLOCK, STEP_TIMERS

Step = RawStep | ScheduledStep


class Scheduled(NamedTuple):
    """A step scheduled, not done yet."""

    step: Step | Callable[[], Step]  # what it computes (or what makes that, when accounted)
    at_ns: int  # when it was scheduled


class StepTable:
    """Steps in flight by key (vLLM's scheduler outputs' ids), and the steps' times."""

    def __init__(self) -> None:
        self.pending: dict[int, Scheduled] = {}
        self.steps = 0  # steps accounted
        self.steps_done = 0  # steps whose output came back
        self.by_timer = dict.fromkeys(STEP_TIMERS, 0)  # steps, by the clock of their time
        self.zero_time_steps = 0  # steps whose time was zero (or less)
        self.last_done_ns: int | None = None

    def __len__(self) -> int:
        """Steps scheduled whose output has not come back."""
        return len(self.pending)

    def scheduled(self, key: int, step: Step | Callable[[], Step], at_ns: int) -> None:
        if len(self.pending) >= MAX_PENDING_STEPS:  # never grows without bound
            self.pending.pop(next(iter(self.pending)))
        self.pending[key] = Scheduled(step, at_ns)

    def done(self, key: int, worker_step_ns: int | None, timer: str | None, now: int
             ) -> tuple[Scheduled, int] | None:
        """The step's output came back at `now`: it and its time, or None for a key no step in
        flight has. The time is the worker's (where the model ran; `timer` names its clock)
        when it sent one; else the engine's wall time since the step could start: after it
        was scheduled and after the previous step finished (with async scheduling they
        overlap; this keeps the steps disjoint). The fallback is counted (`by_timer`) and said
        once in the log."""
        entry = self.pending.pop(key, None)
        if entry is None:
            return None
        self.steps_done += 1
        last = self.last_done_ns
        start = entry.at_ns if last is None else max(entry.at_ns, last)
        self.last_done_ns = now
        if worker_step_ns is None:
            step_ns, timer = now - start, ENGINE_CLOCK
            if self.by_timer[ENGINE_CLOCK] == 0:
                logger.warning(
                    "vllm_piep: a step came back without the worker's step time (the worker "
                    "patches are not installed in the process that runs the model, or an "
                    "executor dropped the output's attributes); its energy uses the engine's "
                    "wall clock between steps, counted in "
                    "piep_engine_steps_total{step_time=\"engine_clock\"}")
        else:
            step_ns = worker_step_ns
            if timer not in self.by_timer:
                timer = STEP_TIMERS[1]
            if self.steps == 0:
                logger.info("vllm_piep: step times from the worker's %s", timer)
        self.by_timer[timer] += 1
        self.steps += 1
        if step_ns <= 0:  # priced as its work alone: no idle or busy energy
            self.zero_time_steps += 1
        return entry, step_ns

    def known_until_ns(self, now_ns: int) -> int:
        """Up to when every step's time is known: now when no step is in flight, else the
        end of the last step done (a step in flight started after it)."""
        if not self.pending:
            return now_ns
        return self.last_done_ns or 0
