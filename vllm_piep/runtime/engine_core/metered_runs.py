"""Engine core, measured mode: decode runs whose energy the meter decides (`MeteredRuns`).

A step's measured energy is its predicted shares times the step's ratio (measured over
predicted), known when the meter speaks for it (`measured_settlement.py`). Steps settle in the
order they were done, so beside the predicted prefix sums (`DecodeRuns.prefix`, a row per step
at its update) a second set is kept at settlement (`settled`: each step's row times its ratio)
and a third for what the meter did not measure (`fitted`: the predicted joules of the steps
the fit settled, and the estimated fraction of the others', summed over the components, for
the `unmeasured` column), all in the same segments of steps. A member's
measured joules are read from `settled` up to the last step settled, its predicted ones from
`prefix` up to the last step done: two anchors per run (`run_j0`, `run_p0`). A request that
leaves its run while steps of it still wait keeps a `Closing` until they settle; the energy goes
to its row, or, where it was released meanwhile, to the outcome its release says. A segment is
dropped once no anchor is in it and every step of it is settled: while the meter is behind,
segments stay. No vLLM imports.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from operator import sub
from typing import NamedTuple

from vllm_piep.runtime.engine_core.decode_runs import SEGMENT, DecodeRuns, PrefixSums
from vllm_piep.runtime.engine_core.request_table import RequestTable
from vllm_piep.runtime.record import COLUMN

_PREDICTED, _UNMEASURED = COLUMN["predicted"], COLUMN["unmeasured"]


class Closing(NamedTuple):
    """A run that ended while steps of it still waited for the meter."""

    req_id: str
    slot: int
    generation: int  # the slot's generation then (its request may be released since)
    j0: int  # the first of its steps not settled yet
    s0: int  # the request's context at that step
    j_end: int  # the step after its last one


class MeteredRuns(DecodeRuns):
    """Decode runs in measured mode (module docstring)."""

    def __init__(self, table: RequestTable, columns: Sequence[int],
                 released: Mapping[str, bool], segment: int = SEGMENT) -> None:
        super().__init__(table, columns, segment)
        c = self.c
        self.settled = PrefixSums(c, segment)
        self.fitted = PrefixSums(1, segment)
        self.settled_j = 0  # steps settled: their rows are in `settled`
        self.closing: deque[Closing] = deque()
        self._closing_slots: Counter[int] = Counter()
        self._released = released  # request id -> aborted (the settler's)

    # -- steps ----------------------------------------------------------------------------------
    def settle_next(self, ratio: float, unmeasured: float) -> None:
        """The next step done is settled: its members' predicted joules times `ratio`;
        `unmeasured` of them (1 for a step settled by the fit, the estimated fraction of a
        reading) go to `unmeasured` too."""
        k = self.settled_j
        segment = self.prefix.segment
        rows = self.prefix.segments[k // segment]
        local = k % segment
        step = tuple(map(sub, rows[local + 1], rows[local]))  # its terms, j A.V's weighted
        self.settled.push_row(tuple(ratio * x for x in step))
        c = self.c
        self.fitted.push_row((unmeasured * sum(step[:c]), unmeasured * sum(step[c:2 * c]),
                              unmeasured * sum(step[2 * c:])) if unmeasured else (0.0, 0.0, 0.0))
        self.settled_j = k + 1
        closing = self.closing
        while closing and closing[0].j_end <= self.settled_j:
            self._close(closing.popleft())
        if self.settled_j % segment == 0 and not self.moving:  # a segment wholly settled
            self._drop()

    def unsettled(self, req_id: str, slot: int | None) -> bool:
        """Whether a step of the request's run still waits for the meter."""
        if req_id in self.members:
            return self.settled_j < self.j
        return slot is not None and self._closing_slots.get(slot, 0) > 0

    # -- reading and folding --------------------------------------------------------------------
    def fold(self, slot: int) -> None:
        """A member's measured joules up to the last step settled, and predicted ones up to the
        last step done, into its row; its anchors move there."""
        table = self.table
        j0, s0, p0 = table.run_j0[slot], table.run_s0[slot], table.run_p0[slot]
        k, j = self.settled_j, self.j
        row = table.rows[slot]
        segment = self.prefix.segment
        if p0 < j:
            row[_PREDICTED] += sum(self.prefix.between(p0, j, s0 + (p0 - j0)))
            self.anchors[p0 // segment] -= 1
            self.anchors[j // segment] += 1
            table.run_p0[slot] = j
        if j0 >= k:  # joined after the last step settled: nothing measured yet
            return
        self._add_decode(row, self.settled.between(j0, k, s0))
        row[_UNMEASURED] += self.fitted.between(j0, k, s0)[0]
        self._anchor(slot, k, s0 + (k - j0))
        self.s0_sum += k - j0
        self.j0_sum += k - j0

    def join(self, req_id: str, slot: int, context: int) -> None:
        super().join(req_id, slot, context)
        self.table.run_p0[slot] = self.j
        self.anchors[self.j // self.prefix.segment] += 1

    def leave(self, req_id: str) -> int | None:
        slot = super().leave(req_id)
        if slot is None:
            return None
        table = self.table
        self.anchors[table.run_p0[slot] // self.prefix.segment] -= 1
        if self.settled_j < self.j:  # steps of it still wait
            self.closing.append(Closing(req_id, slot, table.generation[slot],
                                        table.run_j0[slot], table.run_s0[slot], self.j))
            self.anchors[table.run_j0[slot] // self.prefix.segment] += 1
            self._closing_slots[slot] += 1
        return slot

    def move_context(self, req_id: str, slot: int, context: int) -> None:
        """A member's context from this step on is `context`: steps of it still waiting for
        the meter keep theirs (its run closes, `Closing`), and a new run starts here."""
        self.leave(req_id)
        self.join(req_id, slot, context)

    def leave_all(self) -> None:
        for req_id in list(self.members):
            self.leave(req_id)
        self.s0_sum = self.j0_sum = 0

    def _close(self, run: Closing) -> None:
        """A closed run's measured joules from its first unsettled step to its end, into its
        row, or to the outcome its release says."""
        self.anchors[run.j0 // self.prefix.segment] -= 1
        slots = self._closing_slots
        slots[run.slot] -= 1
        if slots[run.slot] <= 0:
            del slots[run.slot]
        if run.j_end <= run.j0:
            return
        parts = self.settled.between(run.j0, run.j_end, run.s0)
        table = self.table
        if table.generation[run.slot] == run.generation:
            row = table.rows[run.slot]
            self._add_decode(row, parts)
            row[_UNMEASURED] += self.fitted.between(run.j0, run.j_end, run.s0)[0]
        elif self._released.get(run.req_id, True):
            table.outcomes.unsent += sum(parts)
        else:
            table.outcomes.after_finish += sum(parts)

    # -- keeping the segments few ---------------------------------------------------------------
    def _move(self) -> None:
        """Members anchored in an older segment folded, a few per step; one whose measured
        anchor cannot leave it yet (the meter is behind) waits for the next round."""
        moving, members = self.moving, self.members
        segment = self.prefix.segment
        first = (self.j - 1) // segment * segment
        run_j0, run_p0 = self.table.run_j0, self.table.run_p0
        for _ in range(min(self.moves, len(moving))):
            req_id = moving.popleft()
            slot = members.get(req_id)
            if slot is not None and (run_j0[slot] < first or run_p0[slot] < first):
                self.fold(slot)
                if run_j0[slot] < first:
                    moving.append(req_id)
                    break  # the meter is behind: the rest waits for the next step
        if not moving:
            self._drop()

    def _drop(self) -> None:
        """Segments no anchor is in, and every step of which is settled, dropped."""
        segment = self.prefix.segment
        keep = min(self.j, self.settled_j) // segment
        for k in sorted(self.prefix.segments):
            if k >= keep or self.anchors.get(k, 0) > 0:
                break
            self.anchors.pop(k, None)
            for sums in (self.prefix, self.settled, self.fitted):
                sums.drop((k + 1) * segment)

    def _start_moving(self) -> None:
        super()._start_moving()
        if not self.moving:  # no members: the segments behind may go at once
            self._drop()
