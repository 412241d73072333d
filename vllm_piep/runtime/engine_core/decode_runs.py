"""Engine core: requests in runs of one-token decode steps, their energy in closed form.

A request that decodes one token per step from context s0 at step j0 has context s0 + (j - j0)
at step j, so its joules over steps j0..j1-1 are (`predict/split_rule.py`: per step, A_j . U
at context 0 and A_j . V per token of context)

    sum_j A_j.U + (s0 - j0) sum_j A_j.V + sum_j j A_j.V

three prefix sums of per-step vectors: O(1) per step for the engine, O(1) per request read,
whatever the batch. `DecodeRuns` keeps them (`push`, one row per step) and the requests in a
run (`members`; their j0 and s0 in the request table's arrays), and folds a run's joules into
its request's row when the row is read, the request leaves its run, or the prefix sums are
rebased (every `EPOCH` steps, so that they stay small: the error of a difference stays near
`EPOCH` times the rounding of one step, and memory is fixed). No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Container
from itertools import compress, islice
from operator import not_
from typing import NamedTuple

import numpy as np

from vllm_piep.predict.split_rule import ROWS
from vllm_piep.runtime.engine_core.request_table import RequestTable
from vllm_piep.runtime.engine_core.scheduled import RawStep

EPOCH = 4096  # steps between rebases of the prefix sums


class DecodeRuns:
    """The requests in runs of one-token decode steps (module docstring), over `table`'s rows."""

    def __init__(self, table: RequestTable, n_components: int, epoch: int = EPOCH) -> None:
        self.table = table
        self.epoch = epoch
        self.c = n_components
        # Row j: the sums over the epoch's steps before j of A.U, A.V and j A.V.
        self.prefix = np.zeros((epoch + 1, 3, n_components))
        self.j = 0  # the next step's index in the epoch
        self.members: dict[str, int] = {}  # request id -> slot
        # Sums over the members of s0 and j0: their contexts at step j sum to
        # s0_sum - j0_sum + len(members) * j (`expected_context`).
        self.s0_sum = 0.0
        self.j0_sum = 0.0
        self._terms = np.zeros((3, n_components))

    def __len__(self) -> int:
        return len(self.members)

    def expected_context(self) -> float:
        """The members' contexts summed, as of the next step."""
        return self.s0_sum - self.j0_sum + len(self.members) * self.j

    def push(self, terms: np.ndarray | None) -> None:
        """A step done: its split's decode terms ([C, 2], `split_rule.decode_terms`), or None
        for a step whose members' shares were added explicitly (it adds nothing to a run)."""
        self._append(terms)
        if self.j == self.epoch:
            self.rebase()

    def _append(self, terms: np.ndarray | None) -> None:
        """The step's row of the prefix sums (`push`)."""
        j = self.j
        prefix = self.prefix
        if terms is None:
            prefix[j + 1] = prefix[j]
        else:
            row = self._terms
            row[:2] = terms.T
            np.multiply(terms[:, 1], j, out=row[2])
            np.add(prefix[j], row, out=prefix[j + 1])
        self.j = j + 1

    def joules(self, slots: np.ndarray) -> np.ndarray:
        """[len(slots), C] each member slot's joules since its run's anchor."""
        table = self.table
        j0 = table.run_j0[slots]
        start = self.prefix[j0.astype(np.intp)]
        delta = self.prefix[self.j] - start  # [m, 3, C]
        return delta[:, 0] + (table.run_s0[slots] - j0)[:, None] * delta[:, 1] + delta[:, 2]

    def fold(self, slots: np.ndarray) -> None:
        """Member slots' joules so far into their rows; their runs re-anchored at the next
        step (same contexts: the sums are unchanged but for j0's)."""
        if len(slots) == 0:
            return
        table = self.table
        table.add_decode(slots, self.joules(slots))
        j0 = table.run_j0[slots]
        moved = float(self.j * len(slots) - j0.sum())
        table.run_s0[slots] += self.j - j0
        table.run_j0[slots] = self.j
        self.s0_sum += moved
        self.j0_sum += moved

    def fold_ids(self, req_ids: list[str]) -> None:
        """`fold` for those of the requests that are members."""
        get = self.members.get
        slots = [s for s in map(get, req_ids) if s is not None]
        if slots:
            self.fold(np.array(slots, dtype=np.intp))

    def join(self, req_id: str, slot: int, context: float) -> None:
        """The request decodes one token at each step from the next, from `context`."""
        if req_id in self.members:
            self.leave(req_id)
        table = self.table
        table.run_j0[slot] = self.j
        table.run_s0[slot] = context
        self.members[req_id] = slot
        self.s0_sum += context
        self.j0_sum += self.j

    def leave(self, req_id: str) -> int | None:
        """The request's run ends: its joules folded into its row. Its slot, or None for a
        request in no run."""
        slot = self.members.get(req_id)
        if slot is None:
            return None
        self.fold(np.array([slot], dtype=np.intp))
        del self.members[req_id]
        table = self.table
        self.s0_sum -= float(table.run_s0[slot])
        self.j0_sum -= float(table.run_j0[slot])
        return slot

    def leave_all(self) -> None:
        """Every run ends (the explicit path from now on)."""
        self.rebase()
        self.members.clear()
        self.s0_sum = self.j0_sum = 0.0

    def rebase(self) -> None:
        """Every run folded, the prefix sums restarted (module docstring)."""
        if self.members:
            self.fold(np.fromiter(self.members.values(), np.intp, len(self.members)))
            self.table.run_j0[list(self.members.values())] = 0.0
        self.j0_sum = 0.0
        self.j = 0
        self.prefix[0] = 0.0

    # -- which requests go on in their runs ----------------------------------------------------
    def regular(self, raw: RawStep) -> list[int] | None:
        """Whether every member still in a run is in the step, one token on from its expected
        context: the positions of the others (cached non-members, then the new requests), to
        split explicitly; else None. Members with speculative tokens, and members the step
        does not schedule (preempted, or no room), leave their runs first. Checks at C speed
        on vLLM's lists: the cached non-members' count leaves room for every member; the
        cached requests' tokens less the non-members' number one per member; their contexts
        less the non-members' sum to the members' expected sum."""
        members = self.members
        spec = raw.spec_tokens
        if spec:
            for req_id in [r for r in spec if r in members]:
                self.leave(req_id)
        cached_start = raw.start[0]
        nc = len(cached_start)
        ids = raw.req_ids
        others = list(compress(range(nc), map(not_, map(members.__contains__,
                                                          islice(ids, nc)))))
        if nc - len(others) < len(members):
            here = set(islice(ids, nc))
            for req_id in [r for r in members if r not in here]:
                self.leave(req_id)
        if nc - len(others) != len(members):
            return None
        scheduled = raw.scheduled
        tokens = sum(map(scheduled.__getitem__, islice(ids, nc)))
        if others:
            tokens -= sum(scheduled[ids[i]] for i in others)
            context = sum(cached_start) - sum(cached_start[i] for i in others)
        else:
            context = sum(cached_start)
        if tokens != len(members) or context != self.expected_context():
            return None
        others.extend(range(nc, len(ids)))
        return others

    def follow(self, ids: list[str], sched: np.ndarray, base: np.ndarray, slots: np.ndarray,
               regular: bool, gone: Container[str]) -> Disagreement | None:
        """After a step (pushed): its explicit requests that decode one token at each step
        from the next join a run (released ones, `gone`, do not). After a step split
        explicitly for every request (not `regular`), members that did not go one token on
        leave their runs (those that decode next join new ones), and so do members the step
        did not schedule; what the cheap checks would have missed is returned."""
        members = self.members
        nxt = sched[0] + sched[1]  # each request's context at its next step
        decodes = (base[ROWS] > 0) & (sched[3] == 1.0)
        if regular:  # the explicit ones are not members
            for i in np.flatnonzero(decodes):
                if ids[i] not in gone:
                    self.join(ids[i], int(slots[i]), float(nxt[i]))
            return None
        j_before = self.j - 1
        table = self.table
        member_slot = np.fromiter((members.get(r, -1) for r in ids), np.intp, len(ids))
        is_member = member_slot >= 0
        expected = np.where(is_member, table.run_s0[member_slot]
                            + (j_before - table.run_j0[member_slot]), -1.0)
        going_on = is_member & (sched[1] == 1.0) & decodes & (sched[0] == expected)
        stray = is_member & ~going_on
        found = Disagreement(int(stray.sum()), len(members) - int(is_member.sum()))
        for i in np.flatnonzero(stray):
            self.leave(ids[i])
        for i in np.flatnonzero(decodes & ~going_on):
            if ids[i] not in gone:
                self.join(ids[i], int(slots[i]), float(nxt[i]))
        if found.missing:  # not scheduled (preempted, or no room): explicit when back
            here = set(ids)
            for req_id in [r for r in members if r not in here]:
                self.leave(req_id)
        return found


class Disagreement(NamedTuple):
    """Members of a step split explicitly that the cheap checks took to go on in their runs."""

    stray: int  # scheduled, but not one token on from the expected context
    missing: int  # not scheduled

    def __bool__(self) -> bool:
        return bool(self.stray or self.missing)
