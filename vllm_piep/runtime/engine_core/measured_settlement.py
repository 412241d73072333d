"""Engine core: where a predicted step's shares go, chosen once per mode. In prediction mode
(`PredictedSettler`) into its requests' rows at once. In measured mode (`MeasuredSettler`,
`measured.py`) each step waits in the interval splitter until the meter speaks for it
(`settle`); its measured energy then goes into its requests' rows in the proportion of the
predicted shares. No vLLM imports."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from vllm_piep.meters.split import IntervalSplitter, PendingStep, Settled
from vllm_piep.runtime.engine_core.metered_runs import MeteredRuns
from vllm_piep.runtime.engine_core.request_table import RequestTable
from vllm_piep.runtime.engine_core.row_code import scaled_adder, shares_adder
from vllm_piep.runtime.record import COLUMN

_PREDICTED, _UNMEASURED = COLUMN["predicted"], COLUMN["unmeasured"]
_MAX_RELEASED = 4096  # released requests remembered for their steps still to be settled
# A share's first two values are always its prefill and decode joules (`StepShares.columns`).
assert (COLUMN["prefill"], COLUMN["decode"]) == (0, 1)


class StepShares(NamedTuple):
    """A predicted step's shares, as a settler takes them."""

    seq: int  # the step's number among the engine's steps
    req_ids: list[str]
    slots: list[int]  # the requests' slots
    # Per request, its predicted joules for `columns` of its row: prefill, decode, then its
    # components (every one, or the split's live ones).
    shares: list[tuple[float, ...]]
    columns: tuple[int, ...]
    joules: float  # the step's predicted energy (warm-up included)
    static_j: float  # of it, static energy (warm-up included)
    warmup_j: float  # of it, warm-up energy taken out of the shares
    t0_ns: int  # when it ran
    t1_ns: int
    in_runs: bool  # decode runs' members were in it (a row of their prefix sums)


class PredictedSettler:
    """Prediction mode: a step's shares into the rows at once."""

    measured = False

    def __init__(self, table: RequestTable) -> None:
        self.table = table

    def add(self, step: StepShares) -> None:
        if step.slots:
            shares_adder(step.columns)(self.table.rows, step.slots, step.shares)
        outcomes = self.table.outcomes
        outcomes.step_joules += step.joules
        outcomes.warmup += step.warmup_j

    def add_runs_step(self, seq: int, joules: float, static_j: float, warmup_j: float,
                      t0_ns: int, t1_ns: int) -> None:
        """A step of the decode runs' members alone (their prefix sums have its terms)."""
        outcomes = self.table.outcomes
        outcomes.step_joules += joules
        outcomes.warmup += warmup_j


class _Waiting(NamedTuple):
    """A measured-mode step waiting for the meter: what its settlement scales."""

    seq: int
    slots: list[int]
    generations: list[int]  # the slots' generations then (`RequestTable.generation`)
    req_ids: list[str]
    shares: list[tuple[float, ...]]  # predicted shares, for `columns`
    columns: tuple[int, ...]
    warmup_j: float  # predicted warm-up energy taken out of the shares
    in_runs: bool  # its decode runs' row waits too (`metered_runs.py`)


class MeasuredSettler:
    """Measured mode: steps settled by the meter (module docstring)."""

    measured = True

    def __init__(self, table: RequestTable, splitter: IntervalSplitter, meter_name: str,
                 source: str) -> None:
        self.table = table
        self.splitter = splitter
        self.meter_name = meter_name
        self.source = source
        self.predicted_joules = self.idle_joules = self.fitted_joules = 0.0
        self.estimated_joules = 0.0  # the readings' estimates, steps and idle
        self.fallback_steps = 0
        self.settled_seq = 0  # steps settle in order: every step up to this one is settled
        self.released: OrderedDict[str, bool] = OrderedDict()  # req id -> aborted
        self.runs: MeteredRuns | None = None  # the decode runs' steps settle here too

    def add(self, step: StepShares) -> None:
        """The step waits for the meter."""
        table = self.table
        slots = step.slots
        rows, last_seq, generation = table.rows, table.last_seq, table.generation
        for slot, share in zip(slots, step.shares, strict=True):
            rows[slot][_PREDICTED] += share[0] + share[1]
            last_seq[slot] = step.seq
        self.splitter.add_step(PendingStep(
            step.t0_ns, step.t1_ns, step.static_j, max(0.0, step.joules - step.static_j),
            _Waiting(step.seq, slots, [generation[s] for s in slots], step.req_ids,
                     step.shares, step.columns, step.warmup_j, step.in_runs)))

    def add_runs_step(self, seq: int, joules: float, static_j: float, warmup_j: float,
                      t0_ns: int, t1_ns: int) -> None:
        """A step of the decode runs' members alone waits for the meter (its terms wait in
        the runs' prefix sums)."""
        self.splitter.add_step(PendingStep(t0_ns, t1_ns, static_j, max(0.0, joules - static_j),
                                           _Waiting(seq, [], [], [], [], (), warmup_j, True)))

    def note_release(self, req_id: str, aborted: bool) -> None:
        """A released request: its steps still waiting go to no output (unsent or not)."""
        released = self.released
        released[req_id] = aborted
        released.move_to_end(req_id)
        if len(released) > _MAX_RELEASED:
            released.popitem(last=False)

    def settle(self, known_until_ns: int, fallback: bool = False) -> int:
        """Settle the steps the meter's readings cover up to `known_until_ns` (or, with
        `fallback`, the steps ended by then, by the fit): their measured energy goes into the
        rows of their requests. Returns how many steps were settled."""
        splitter = self.splitter
        if not fallback and not splitter.readings_waiting:
            return 0
        done = splitter.fallback(known_until_ns) if fallback else splitter.settle(known_until_ns)
        self._apply(done)
        return len(done.steps)

    def _apply(self, done: Settled) -> None:
        self.idle_joules += done.idle_j
        self.estimated_joules += done.estimated_j
        table = self.table
        rows, generation = table.rows, table.generation
        outcomes = table.outcomes
        for step in done.steps:
            waiting: _Waiting = step.payload
            ratio = step.ratio
            outcomes.step_joules += step.measured_j
            outcomes.warmup += ratio * waiting.warmup_j
            self.predicted_joules += step.predicted_j
            unmeasured = step.unmeasured  # the part by the fit or estimated, 0 to 1
            if step.fallback:
                self.fitted_joules += step.fitted_j
                self.fallback_steps += 1
            if waiting.in_runs and self.runs is not None:
                self.runs.settle_next(ratio, unmeasured)
            if not waiting.slots:
                self.settled_seq = waiting.seq
                continue
            add = scaled_adder(waiting.columns)
            for slot, then, req_id, share in zip(waiting.slots, waiting.generations,
                                                 waiting.req_ids, waiting.shares, strict=True):
                if generation[slot] == then:
                    row = rows[slot]
                    add(row, share, ratio)
                    if unmeasured:
                        row[_UNMEASURED] += (share[0] + share[1]) * unmeasured
                else:  # released since: no output will carry it
                    joules = ratio * share[0] + ratio * share[1]
                    if self.released.get(req_id, True):
                        outcomes.unsent += joules
                    else:
                        outcomes.after_finish += joules
            self.settled_seq = waiting.seq

    def unsettled(self, slot: int | None) -> bool:
        """Whether a step of the request in `slot` still waits for the meter."""
        return slot is not None and self.table.last_seq[slot] > self.settled_seq
