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

import numpy as np

from vllm_piep.runtime.engine_core.request_table import RequestTable
from vllm_piep.runtime.record import COLUMN

_DECODE = COLUMN["decode"]
_FIRST = 2  # the first component column of a row (after prefill, decode)
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
        if self.j == self.epoch:
            self.rebase()

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
        parts = self.joules(slots)
        rows = table.rows
        rows[slots, _FIRST:_FIRST + self.c] += parts
        rows[slots, _DECODE] += parts.sum(axis=1)
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
