"""Engine core, measured mode: decode runs whose energy the meter decides (`MeteredRuns`).

A step's measured energy is its predicted shares times the step's ratio (measured over
predicted), known when the meter speaks for it (`measured_settlement.py`). Steps settle in the
order they were done, so beside the predicted prefix sums (`DecodeRuns.prefix`, a row per step
at its update) a second set is kept at settlement (`settled`: each step's row times its ratio)
and a third for the steps the fit settled (`fitted`: their predicted joules, summed over the
components, for the `unmeasured` column). A member's measured joules are read from `settled`
up to the last step settled, its predicted ones from `prefix` up to the last step done: two
anchors per run (`run_j0`, `run_p0`). A request that leaves its run while steps of it still
wait keeps a `Closing` until they settle; the energy goes to its row, or, where it was
released meanwhile, to the outcome its release says. The prefix sums shift down (`shift`) once
half an epoch has settled, and grow while the meter is behind. No vLLM imports.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from vllm_piep.runtime.engine_core.decode_runs import EPOCH, DecodeRuns
from vllm_piep.runtime.engine_core.request_table import RequestTable
from vllm_piep.runtime.record import COLUMN

_PREDICTED, _UNMEASURED = COLUMN["predicted"], COLUMN["unmeasured"]


class Closing(NamedTuple):
    """A run that ended while steps of it still waited for the meter."""

    req_id: str
    slot: int
    generation: int  # the slot's generation then (its request may be released since)
    j0: int  # the first of its steps not settled yet
    s0: float  # the request's context at that step
    j_end: int  # the step after its last one


class MeteredRuns(DecodeRuns):
    """Decode runs in measured mode (module docstring)."""

    def __init__(self, table: RequestTable, n_components: int,
                 released: Mapping[str, bool], epoch: int = EPOCH) -> None:
        super().__init__(table, n_components, epoch)
        self.prefix = np.zeros((2 * epoch + 1, 3, n_components))
        self.settled = np.zeros_like(self.prefix)
        self.fitted = np.zeros((2 * epoch + 1, 3))
        self.settled_j = 0  # steps settled: rows below it are in `settled`
        self.closing: deque[Closing] = deque()
        self._closing_slots: Counter[int] = Counter()
        self._released = released  # request id -> aborted (the settler's)

    # -- steps ----------------------------------------------------------------------------------
    def push(self, terms: np.ndarray | None) -> None:
        if self.j + 1 >= len(self.prefix):
            self._grow()
        self._append(terms)
        if self.settled_j >= self.epoch // 2 and self.j >= self.epoch:
            self.shift()

    def settle_next(self, ratio: float, fallback: bool) -> None:
        """The next step done is settled: its members' predicted joules times `ratio`
        (`fallback`: by the fit, their predicted joules go to `unmeasured` too)."""
        k = self.settled_j
        step = self.prefix[k + 1] - self.prefix[k]
        np.add(self.settled[k], ratio * step, out=self.settled[k + 1])
        self.fitted[k + 1] = self.fitted[k] + (step.sum(axis=1) if fallback else 0.0)
        self.settled_j = k + 1
        closing = self.closing
        while closing and closing[0].j_end <= self.settled_j:
            self._close(closing.popleft())

    def unsettled(self, req_id: str, slot: int | None) -> bool:
        """Whether a step of the request's run still waits for the meter."""
        if req_id in self.members:
            return self.settled_j < self.j
        return slot is not None and self._closing_slots.get(slot, 0) > 0

    # -- reading and folding --------------------------------------------------------------------
    def _between(self, sums: np.ndarray, j0: np.ndarray, j1: int, s0: np.ndarray) -> np.ndarray:
        """Per run, the sums' joules from step j0 (context s0) to step j1 (`sums`: a prefix
        array, [.., 3, C] or [.., 3])."""
        delta = sums[j1] - sums[j0.astype(np.intp)]  # [m, 3, C]
        return delta[:, 0] + (s0 - j0)[:, None] * delta[:, 1] + delta[:, 2]

    def fold(self, slots: np.ndarray) -> None:
        """Member slots' measured joules up to the last step settled, and predicted ones up to
        the last step done, into their rows; their anchors move there."""
        if len(slots) == 0:
            return
        table = self.table
        j0, s0, p0 = table.run_j0[slots], table.run_s0[slots], table.run_p0[slots]
        k, j = self.settled_j, self.j
        predicted = self._between(self.prefix, p0, j, s0 + (p0 - j0))
        table.add_column(slots, _PREDICTED, predicted.sum(axis=1))
        table.run_p0[slots] = j
        settled = j0 < k  # runs that joined after the last step settled have nothing yet
        if not settled.all():
            slots, j0, s0 = slots[settled], j0[settled], s0[settled]
            if len(slots) == 0:
                return
        table.add_decode(slots, self._between(self.settled, j0, k, s0))
        unmeasured = self._between(self.fitted[:, :, None], j0, k, s0)[:, 0]
        table.add_column(slots, _UNMEASURED, unmeasured)
        moved = float(k * len(slots) - j0.sum())
        table.run_s0[slots] = s0 + (k - j0)
        table.run_j0[slots] = k
        self.s0_sum += moved
        self.j0_sum += moved

    def join(self, req_id: str, slot: int, context: float) -> None:
        super().join(req_id, slot, context)
        self.table.run_p0[slot] = self.j

    def leave(self, req_id: str) -> int | None:
        slot = super().leave(req_id)
        if slot is not None and self.settled_j < self.j:  # steps of it still wait
            table = self.table
            self.closing.append(Closing(req_id, slot, int(table.generation[slot]),
                                        int(table.run_j0[slot]), float(table.run_s0[slot]),
                                        self.j))
            self._closing_slots[slot] += 1
        return slot

    def leave_all(self) -> None:
        for req_id in list(self.members):
            self.leave(req_id)
        self.s0_sum = self.j0_sum = 0.0

    def rebase(self) -> None:  # measured runs shift instead (`shift`)
        self.shift()

    def _close(self, run: Closing, upto: int | None = None) -> None:
        """A closed run's measured joules from its first unsettled step to `upto` (default: its
        end), into its row, or to the outcome its release says."""
        end = run.j_end if upto is None else upto
        if end <= run.j0:  # none of its steps settled in this span
            self._forget_closing(run, upto)
            return
        j0, s0 = np.array([float(run.j0)]), np.array([run.s0])
        parts = self._between(self.settled, j0, end, s0)
        unmeasured = self._between(self.fitted[:, :, None], j0, end, s0)[:, 0]
        table = self.table
        if int(table.generation[run.slot]) == run.generation:
            slots = np.array([run.slot])
            table.add_decode(slots, parts)
            table.add_column(slots, _UNMEASURED, unmeasured)
        elif self._released.get(run.req_id, True):
            table.outcomes.unsent += float(parts.sum())
        else:
            table.outcomes.after_finish += float(parts.sum())
        self._forget_closing(run, upto)

    def _forget_closing(self, run: Closing, upto: int | None) -> None:
        if upto is None:  # the whole run is settled: it waits no more
            self._closing_slots[run.slot] -= 1
            if self._closing_slots[run.slot] <= 0:
                del self._closing_slots[run.slot]

    # -- keeping the arrays small ---------------------------------------------------------------
    def shift(self) -> None:
        """Every run folded up to the last step settled, and the prefix sums moved down by
        that many steps, so that their rows stay few and their values small."""
        k = self.settled_j
        if k == 0:
            return
        if self.members:
            self.fold(np.fromiter(self.members.values(), np.intp, len(self.members)))
        closing = self.closing
        for i, run in enumerate(closing):  # their settled part now: they start at k
            if run.j0 < k:
                self._close(run, upto=k)
                closing[i] = run._replace(j0=k, s0=run.s0 + (k - run.j0))
        j = self.j
        for sums in (self.prefix, self.settled, self.fitted):
            top = j if sums is not self.settled and sums is not self.fitted else k
            rows = sums[k:top + 1] - sums[k]
            rows[:, 2] -= k * rows[:, 1]  # the j-weighted sums, for steps renumbered from 0
            sums[:top - k + 1] = rows
        table = self.table
        if self.members:
            slots = np.fromiter(self.members.values(), np.intp, len(self.members))
            table.run_j0[slots] -= k
            table.run_p0[slots] -= k
        for i, run in enumerate(closing):
            closing[i] = run._replace(j0=run.j0 - k, j_end=run.j_end - k)
        self.j0_sum -= k * len(self.members)
        self.j = j - k
        self.settled_j = 0

    def _grow(self) -> None:
        """The meter is behind by more steps than the arrays hold: twice the rows."""
        for name in ("prefix", "settled", "fitted"):
            old = getattr(self, name)
            new = np.zeros((2 * len(old) - 1, *old.shape[1:]))
            new[:len(old)] = old
            setattr(self, name, new)
