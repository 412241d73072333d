"""Engine core, measured mode (`measured.py`): each predicted step waits in the interval splitter
until the meter speaks for it (`MeasuredSettlement.settle`); its measured energy then goes into
its requests' rows in the proportion of the predicted shares."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vllm_piep.meters.split import IntervalSplitter, PendingStep, Settled
from vllm_piep.predict.stepgraph import N_OUT
from vllm_piep.runtime.engine_core.decode_runs import DecodeRuns
from vllm_piep.runtime.engine_core.request_table import RequestTable
from vllm_piep.runtime.engine_core.scheduled import (
    RawStep,
    ScheduledStep,
)
from vllm_piep.runtime.record import COLUMN

_PREFILL, _DECODE, _INCOMPLETE = COLUMN["prefill"], COLUMN["decode"], COLUMN["incomplete"]
_STATIC = COLUMN["static"]
_PREDICTED, _UNMEASURED = COLUMN["predicted"], COLUMN["unmeasured"]
class StepPayload(NamedTuple):
    """A measured-mode step waiting for the meter: what its settlement scales."""

    seq: int
    slots: np.ndarray
    generations: np.ndarray  # the slots' generations then (`RequestTable.generation`)
    req_ids: list[str]
    increment: np.ndarray  # [N, N_OUT] predicted shares
    warmup_j: float  # predicted warm-up energy taken out of the shares


class MeasuredSettlement:
    """Steps settled by the meter (module docstring). A part of `EngineAccountant`
    (`accountant.py`), which sets up the state it uses."""

    splitter: IntervalSplitter | None
    table: RequestTable
    runs: DecodeRuns | None

    def measure_with(self, splitter: IntervalSplitter, meter_name: str, source: str) -> None:
        """From now on each step waits for the meter (`settle`)."""
        with self.lock:
            if self.runs is not None:  # the steps before: predicted, folded into the rows
                self.runs.leave_all()
            self.splitter, self.meter_name, self.meter_source = splitter, meter_name, source

    def _defer(self, step: ScheduledStep | RawStep, slots: np.ndarray, increment: np.ndarray,
               warmup_j: float, total: float, t0_ns: int, t1_ns: int,
               forget: bool = True, ids: list[str] | None = None) -> None:
        """A predicted step waits for the meter (step number `_seq`); `forget`: released
        requests it named are forgotten now (else by the caller). `ids`: the requests of
        `slots` (default: the step's)."""
        req_ids = step.req_ids if ids is None else ids
        assert self.splitter is not None
        rows = self.table.rows
        rows[slots, _PREDICTED] += increment[:, _PREFILL] + increment[:, _DECODE]
        seq = self._seq
        self.table.last_seq[slots] = seq
        static = float(increment[:, _STATIC].sum()) + warmup_j
        self.splitter.add_step(PendingStep(
            t0_ns, t1_ns, static, max(0.0, total - static),
            StepPayload(seq, slots, self.table.generation[slots], req_ids, increment,
                        warmup_j)))
        if forget and self._gone:
            self._forget_gone(req_ids)

    def steps_in_flight(self) -> int:
        """Steps scheduled whose output has not come back."""
        return len(self._pending)

    def known_until_ns(self) -> int:
        """Up to when every step's time is known: now when no step is in flight, else the
        end of the last step done (a step in flight started after it)."""
        if not self._pending:
            return self.now_ns()
        return self._last_done_ns or 0

    def settle(self, fallback_until_ns: int | None = None) -> int:
        """Settle the steps the meter's readings cover (or, with `fallback_until_ns`, the
        steps ended by then, by the fit): their measured energy goes into the rows of their
        requests. Returns how many steps were settled. Call with `lock` held."""
        splitter = self.splitter
        if splitter is None:
            return 0
        if fallback_until_ns is None and not splitter.readings_waiting:
            return 0
        if fallback_until_ns is None:
            done = splitter.settle(self.known_until_ns())
        else:
            done = splitter.fallback(fallback_until_ns)
        self._apply_settled(done)
        return len(done.steps)

    def _apply_settled(self, done: Settled) -> None:
        self.idle_joules += done.idle_j
        rows = self.table.rows
        for step in done.steps:
            payload: StepPayload = step.payload
            ratio = step.ratio
            self.total_joules += step.measured_j
            self.predicted_joules += step.predicted_j
            self.warmup_joules += ratio * payload.warmup_j
            if step.fallback:
                self.fitted_joules += step.fitted_j
                self.fallback_steps += 1
            scaled = payload.increment * ratio
            slots = payload.slots
            mine = self.table.generation[slots] == payload.generations
            rows[slots[mine], :N_OUT] += scaled[mine]
            if step.fallback:
                increment = payload.increment[mine]
                rows[slots[mine], _UNMEASURED] += (increment[:, _PREFILL]
                                                   + increment[:, _DECODE])
            for i in np.flatnonzero(~mine):  # released since: no output will carry it
                joules = float(scaled[i, _PREFILL] + scaled[i, _DECODE])
                if self._released.get(payload.req_ids[i], True):
                    self.unsent_joules += joules
                else:
                    self.after_finish_joules += joules
            self.settled_seq = payload.seq

    def unsettled(self, req_id: str) -> bool:
        """Whether a step of the request still waits for the meter."""
        slot = self.table.slots.get(req_id)
        return slot is not None and int(self.table.last_seq[slot]) > self.settled_seq
