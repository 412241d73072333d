"""Engine core: requests in runs of one-token decode steps, their energy in closed form.

A request that decodes one token per step from context s0 at step j0 has context s0 + (j - j0)
at step j, so its joules over steps j0..j1-1 are (`predict/split_rule.py`: per step, A_j . U
at context 0 and A_j . V per token of context)

    sum_j A_j.U + (s0 - j0) sum_j A_j.V + sum_j j A_j.V

three prefix sums of per-step terms: O(1) per step for the engine, O(1) per request read,
whatever the batch. `PrefixSums` keeps them, a row per step, in segments of `SEGMENT` steps
whose j counts from the segment's start (so that the sums stay small and a difference keeps
its precision); a segment no run is anchored in any more is dropped, and the runs anchored in
an older one are folded a few per step (`MOVES_PER_STEP`) once a new one starts, so that memory
is fixed and no step folds them all at once. `DecodeRuns` keeps the requests in a run
(`members`; their j0 and s0 in the request table's lists, j counted over the engine's life) and
folds a run's joules into its request's row when the row is read or the request leaves its
run. Plain Python: a step pushes one row of a few numbers. No vLLM imports.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Container, Sequence
from itertools import compress, islice
from operator import not_
from typing import NamedTuple

from vllm_piep.predict.split_code import Extra, extra
from vllm_piep.runtime.engine_core.request_table import RequestTable
from vllm_piep.runtime.engine_core.row_code import (
    decode_adder,
    run_joules,
    run_per_token,
    run_row,
)
from vllm_piep.runtime.engine_core.scheduled import RawStep

SEGMENT = 1024  # steps per segment of the prefix sums
# Rows of a dropped segment freed per step: a segment freed at once (a thousand tuples of a few
# dozen floats) held the interpreter for half a millisecond.
FREE_ROWS = 32
# Members anchored in an older segment, folded per step once a new segment starts: all of them
# within a quarter of a segment (at least this many per step).
MOVES_PER_STEP = 2
# Every `AUDIT_EVERY` regular steps, `AUDIT_WINDOW` members are checked one by one
# (`DecodeRuns.audit`), the next ones the next time: every member within a few dozen steps.
AUDIT_EVERY = 4
AUDIT_WINDOW = 16


class PrefixSums:
    """Per step, a row of running sums of a decode run's terms for `parts` components (A.U,
    A.V and j A.V of each, j counted from the step's segment's start), in segments of
    `segment` steps: row l of segment k is the sums over the segment's steps before step
    k * segment + l."""

    def __init__(self, parts: int, segment: int = SEGMENT) -> None:
        self.parts = parts
        self.segment = segment
        self.zero = (0.0,) * (3 * parts)
        self.segments: dict[int, list[tuple[float, ...]]] = {0: [self.zero]}
        self.dropped: list[list[tuple[float, ...]]] = []  # segments freed a few rows a step
        self.steps = 0  # steps pushed
        self._row = run_row(parts)
        self._joules = run_joules(parts)
        self._per_token = run_per_token(parts)

    def push(self, terms: Sequence[float] | None) -> bool:
        """The next step's terms (A.U then A.V per component; None: nothing); whether it
        started a new segment."""
        k, local = divmod(self.steps, self.segment)
        rows = self.segments.get(k)
        started = rows is None
        if started:
            rows = self.segments[k] = [self.zero]
        rows.append(rows[-1] if terms is None else self._row(rows[-1], terms, local))
        self.steps += 1
        if self.dropped:
            self._free_some()
        return started

    def _free_some(self) -> None:
        """`FREE_ROWS` rows of the dropped segments freed."""
        rows = self.dropped[-1]
        del rows[-FREE_ROWS:]
        if not rows:
            self.dropped.pop()

    def push_row(self, row: tuple[float, ...]) -> None:
        """The next step's increment of every sum (already weighted by its j)."""
        k = self.steps // self.segment
        rows = self.segments.get(k)
        if rows is None:
            rows = self.segments[k] = [self.zero]
        last = rows[-1]
        rows.append(tuple(a + b for a, b in zip(last, row, strict=True)))
        self.steps += 1
        if self.dropped:
            self._free_some()

    def between(self, j0: int, j1: int, s0: int) -> tuple[float, ...]:
        """Per component, the joules of a run from step j0 (context s0) to step j1:
        sum_j A_j.U + (s0 + j - j0) A_j.V, segment by segment."""
        segment = self.segment
        k = j0 // segment
        first = k * segment
        if j1 <= first + segment:  # within one segment: the common case
            rows = self.segments[k]
            return self._joules(rows[j1 - first], rows[j0 - first], s0 - (j0 - first))
        out = [0.0] * self.parts
        while j0 < j1:
            k = j0 // segment
            first = k * segment
            end = min(j1, first + segment)
            rows = self.segments[k]
            part = self._joules(rows[end - first], rows[j0 - first], s0 - (j0 - first))
            out = [x + y for x, y in zip(out, part, strict=True)]
            s0 += end - j0
            j0 = end
        return tuple(out)

    def per_token(self, j0: int, j1: int, x: float) -> tuple[float, ...]:
        """Per component, `x` times the joules per token of context of a run from step j0 to
        step j1 (x sum_j A_j.V), segment by segment."""
        segment = self.segment
        out: tuple[float, ...] | None = None
        while j0 < j1:
            k = j0 // segment
            first = k * segment
            end = min(j1, first + segment)
            rows = self.segments[k]
            part = self._per_token(rows[end - first], rows[j0 - first], x)
            out = part if out is None else tuple(a + b for a, b in zip(out, part, strict=True))
            j0 = end
        return out if out is not None else (0.0,) * self.parts

    def drop(self, keep: int) -> None:
        """Segments before the one holding step `keep` dropped (their memory freed over the
        next steps, `FREE_ROWS` rows a step)."""
        first = keep // self.segment
        for k in [k for k in self.segments if k < first]:
            self.dropped.append(self.segments.pop(k))


class DecodeRuns:
    """The requests in runs of one-token decode steps (module docstring), over `table`'s rows:
    decode joules of components `columns` (the record's columns of the split's live
    components)."""

    def __init__(self, table: RequestTable, columns: Sequence[int],
                 segment: int = SEGMENT) -> None:
        self.table = table
        self.columns = tuple(columns)
        self.c = len(self.columns)
        self.prefix = PrefixSums(self.c, segment)
        self._add_decode = decode_adder(self.columns)
        self.j = 0  # the next step's number
        self.members: dict[str, int] = {}  # request id -> slot
        # Sums over the members of s0 and j0: their contexts at step j sum to
        # s0_sum - j0_sum + len(members) * j (`expected_context`).
        self.s0_sum = 0
        self.j0_sum = 0
        # Anchors per segment (`anchored`): a segment none is anchored in can be dropped.
        self.anchors: Counter[int] = Counter()
        self.moving: deque[str] = deque()  # members to fold out of an older segment
        # Members whose last step had speculative tokens: their context moved on by the drafts
        # accepted, which the next step reads (`regular`).
        self.jumps: list[str] = []
        self.moves = MOVES_PER_STEP
        self._audit_at = 0

    def __len__(self) -> int:
        return len(self.members)

    def expected_context(self) -> int:
        """The members' contexts summed, as of the next step."""
        return self.s0_sum - self.j0_sum + len(self.members) * self.j

    def _anchor(self, slot: int, j0: int, s0: int) -> None:
        table = self.table
        segment = self.prefix.segment
        self.anchors[table.run_j0[slot] // segment] -= 1
        self.anchors[j0 // segment] += 1
        table.run_j0[slot] = j0
        table.run_s0[slot] = s0

    def push(self, terms: Sequence[float] | None) -> None:
        """A step done: its split's decode terms (`split_code`: A.U then A.V per component), or
        None for a step whose members' shares were added explicitly (it adds nothing to a
        run); then a few members anchored in an older segment folded."""
        if self.prefix.push(terms):
            self._start_moving()
        self.j += 1
        if self.moving:
            self._move()

    def _start_moving(self) -> None:
        """A new segment: every member is folded out of the older ones, a few per step."""
        self.moving.extend(self.members)
        self.moves = max(MOVES_PER_STEP, -(-len(self.moving) * 4 // self.prefix.segment))

    def _move(self) -> None:
        moving, members = self.moving, self.members
        first = (self.j - 1) // self.prefix.segment * self.prefix.segment
        for _ in range(min(self.moves, len(moving))):
            slot = members.get(moving.popleft())
            if slot is not None and self.table.run_j0[slot] < first:
                self.fold(slot)
        if not moving:
            self._drop()

    def _drop(self) -> None:
        """Segments no run is anchored in any more, dropped."""
        segment = self.prefix.segment
        keep = self.j // segment
        for k in sorted(self.prefix.segments):
            if k >= keep or self.anchors.get(k, 0) > 0:
                break
            self.anchors.pop(k, None)
            self.prefix.drop((k + 1) * segment)

    def fold(self, slot: int) -> None:
        """A member's joules so far into its row; its run re-anchored at the next step (same
        context: the sums are unchanged but for j0's)."""
        table = self.table
        j0, j = table.run_j0[slot], self.j
        if j0 == j:
            return
        s0 = table.run_s0[slot]
        self._add_decode(table.rows[slot], self.prefix.between(j0, j, s0))
        self._anchor(slot, j, s0 + (j - j0))
        self.s0_sum += j - j0
        self.j0_sum += j - j0

    def fold_ids(self, req_ids: Sequence[str]) -> None:
        """`fold` for those of the requests that are members."""
        get = self.members.get
        for req_id in req_ids:
            slot = get(req_id)
            if slot is not None:
                self.fold(slot)

    def join(self, req_id: str, slot: int, context: int) -> None:
        """The request decodes one token at each step from the next, from `context`."""
        if req_id in self.members:
            self.leave(req_id)
        table = self.table
        table.run_j0[slot] = self.j
        table.run_s0[slot] = context
        self.anchors[self.j // self.prefix.segment] += 1
        self.members[req_id] = slot
        self.s0_sum += context
        self.j0_sum += self.j

    def leave(self, req_id: str) -> int | None:
        """The request's run ends: its joules folded into its row. Its slot, or None for a
        request in no run."""
        slot = self.members.get(req_id)
        if slot is None:
            return None
        self.fold(slot)
        del self.members[req_id]
        table = self.table
        self.anchors[table.run_j0[slot] // self.prefix.segment] -= 1
        self.s0_sum -= table.run_s0[slot]
        self.j0_sum -= table.run_j0[slot]
        return slot

    def leave_all(self) -> None:
        """Every run ends (the explicit path from now on)."""
        for req_id in list(self.members):
            self.leave(req_id)
        self.s0_sum = self.j0_sum = 0

    # -- which requests go on in their runs ----------------------------------------------------
    def regular(self, raw: RawStep) -> tuple[list[int], Speculative | None] | None:
        """Whether every member still in a run is in the step, one token on from its expected
        context (or more: its speculative tokens): the positions of the others (cached
        non-members, then the new requests), to split explicitly, and the members with
        speculative tokens, whose extra tokens are split explicitly; else None. Members the
        step does not schedule (preempted, or no room) leave their runs first, and members
        whose context moved on by their accepted speculative tokens are re-anchored there.
        Checks at C speed on vLLM's lists: the cached non-members' count leaves room for every
        member; the cached requests' tokens less the non-members' and the speculative ones
        number one per member; their contexts less the non-members' sum to the members'
        expected sum."""
        members = self.members
        cached_start = raw.start[0]
        nc = len(cached_start)
        ids = raw.req_ids
        if self.jumps:
            self._follow_jumps(ids, cached_start, nc)
        scheduled = raw.scheduled
        if nc == len(members) and all(map(members.__contains__, islice(ids, nc))):
            others: list[int] = []  # the common case: every cached request is a member
            tokens = raw.tokens - sum(map(scheduled.__getitem__, islice(ids, nc, None))) \
                if raw.tokens >= 0 else sum(map(scheduled.__getitem__, islice(ids, nc)))
            context = sum(cached_start)
        else:
            others = list(compress(range(nc), map(not_, map(members.__contains__,
                                                              islice(ids, nc)))))
            if nc - len(others) < len(members):
                here = set(islice(ids, nc))
                for req_id in [r for r in members if r not in here]:
                    self.leave(req_id)
            if nc - len(others) != len(members):
                return None
            tokens = sum(map(scheduled.__getitem__, islice(ids, nc)))
            tokens -= sum(scheduled[ids[i]] for i in others)
            context = sum(cached_start) - sum(cached_start[i] for i in others)
        speculative = None
        spec = raw.spec_tokens
        if spec:
            speculative = Speculative([], [], [])
            run_j0, run_s0, j = self.table.run_j0, self.table.run_s0, self.j
            for req_id, drafts in spec.items():
                slot = members.get(req_id)
                if slot is not None:
                    n = scheduled[req_id]
                    tokens -= n - 1
                    speculative.ids.append(req_id)
                    speculative.slots.append(slot)
                    speculative.extras.append(extra(run_s0[slot] + (j - run_j0[slot]), n,
                                                    1 + len(drafts)))
        if tokens != len(members) or context != self.expected_context():
            return None
        if speculative:  # their contexts move on by the drafts accepted: seen next step
            self.jumps = speculative.ids
        others.extend(range(nc, len(ids)))
        return others, speculative

    def _follow_jumps(self, ids: Sequence[str], cached_start: Sequence[int], nc: int) -> None:
        """Members that had speculative tokens in the last step, re-anchored at the context
        this step reads (the tokens they accepted moved it on); those not scheduled leave in
        `regular`."""
        jumps, self.jumps = self.jumps, []
        members, table, j = self.members, self.table, self.j
        at = dict(zip(islice(ids, nc), range(nc))) if len(jumps) > 8 else None
        for req_id in jumps:
            slot = members.get(req_id)
            if slot is None:
                continue
            if at is not None:
                i = at.get(req_id, -1)
            else:
                try:
                    i = ids.index(req_id, 0, nc)
                except ValueError:
                    continue
            if i >= 0 and cached_start[i] != table.run_s0[slot] + (j - table.run_j0[slot]):
                self.move_context(req_id, slot, cached_start[i])

    def move_context(self, req_id: str, slot: int, context: int) -> None:
        """A member's context from this step on is `context`, `jump` more than its run says:
        its anchor's context moves by the jump, and the joules that gives the steps so far
        (the jump times their joules per token of context) are taken from its row now."""
        table = self.table
        j0, j = table.run_j0[slot], self.j
        jump = context - (table.run_s0[slot] + (j - j0))
        if j > j0:
            self._add_decode(table.rows[slot], self.prefix.per_token(j0, j, -jump))
        table.run_s0[slot] += jump
        self.s0_sum += jump

    def audit(self, raw: RawStep, window: int = AUDIT_WINDOW) -> Disagreement | None:
        """Every `AUDIT_EVERY` steps, up to `window` of a regular step's cached requests,
        from where the last audit stopped, checked one by one: each member scheduled one token
        (and its speculative ones) on from its expected context. The sums `regular` compares
        could hide two errors that cancel; a disagreement ends the closed form."""
        cached_start = raw.start[0]
        nc = len(cached_start)
        if not nc or self.j % AUDIT_EVERY:
            return None
        at = self._audit_at if self._audit_at < nc else 0
        end = min(nc, at + window)
        self._audit_at = end
        ids, scheduled, members, spec = raw.req_ids, raw.scheduled, self.members, \
            raw.spec_tokens
        run_j0, run_s0, j = self.table.run_j0, self.table.run_s0, self.j
        stray = 0
        for i in range(at, end):
            req_id = ids[i]
            slot = members.get(req_id)
            if slot is not None and (
                    scheduled[req_id] != 1 + (len(spec.get(req_id, ())) if spec else 0)
                    or cached_start[i] != run_s0[slot] + (j - run_j0[slot])):
                stray += 1
        return Disagreement(stray, 0) if stray else None

    def follow(self, ids: Sequence[str], nxt: Sequence[int], decodes: Sequence[bool],
               ones: Sequence[bool], starts: Sequence[int], slots: Sequence[int],
               regular: bool, gone: Container[str]) -> Disagreement | None:
        """After a step (pushed), over its explicit requests (`nxt`: each one's context at its
        next step; `decodes`: it sampled a row without speculative tokens; `ones`: it was
        scheduled one token): those that decode join a run (released ones, `gone`, do not).
        After a step split explicitly for every request (not `regular`), members that did not
        go one token on leave their runs (those that decode next join new ones), and so do
        members the step did not schedule; what the cheap checks would have missed is
        returned."""
        members = self.members
        if regular:  # the explicit ones are not members
            for i in compress(range(len(ids)), decodes):
                if ids[i] not in gone:
                    self.join(ids[i], slots[i], nxt[i])
            return None
        self.jumps = []  # every member is checked one by one below
        j_before = self.j - 1
        table = self.table
        run_j0, run_s0 = table.run_j0, table.run_s0
        present = 0
        strays: list[str] = []
        joins: list[int] = []
        for i, req_id in enumerate(ids):
            slot = members.get(req_id)
            going_on = False
            if slot is not None:
                present += 1
                going_on = (ones[i] and decodes[i]
                            and starts[i] == run_s0[slot] + (j_before - run_j0[slot]))
                if not going_on:
                    strays.append(req_id)
            if decodes[i] and not going_on and req_id not in gone:
                joins.append(i)
        found = Disagreement(len(strays), len(members) - present)
        for req_id in strays:
            self.leave(req_id)
        for i in joins:
            self.join(ids[i], slots[i], nxt[i])
        if found.missing:  # not scheduled (preempted, or no room): explicit when back
            here = set(ids)
            for req_id in [r for r in members if r not in here]:
                self.leave(req_id)
        return found


class Speculative(NamedTuple):
    """A step's run members that compute speculative tokens: their ids, slots, and features
    beyond a one-token decode's (split explicitly), in one order."""

    ids: list[str]
    slots: list[int]
    extras: list[Extra]

    def __bool__(self) -> bool:
        return bool(self.ids)


class Disagreement(NamedTuple):
    """Members of a step that the cheap checks took to go on in their runs but do not."""

    stray: int  # scheduled, but not one token on from the expected context
    missing: int  # not scheduled

    def __bool__(self) -> bool:
        return bool(self.stray or self.missing)
