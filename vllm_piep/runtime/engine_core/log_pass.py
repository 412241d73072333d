"""Engine core, sparse mode: the log of a served engine's steps, releases and held outputs, and
its evaluation in one pass (`LogPass.evaluate`): the steps' requests mapped to their slots of
the request table together, the predictor called once for every step of the log
(`StepGraph.run_many`), then the shares added as columns, each release and held output applied
where it was logged. Evaluating `MAX_UNEVALUATED` steps at once costs about what evaluating one
did: most of a step's cost here is the cold caches the loop meets after each wait on the
device, paid once per pass."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from vllm_piep.predict.stepgraph import N_OUT
from vllm_piep.runtime.engine_core.request_table import RequestTable
from vllm_piep.runtime.engine_core.scheduled import (
    RawStep,
    ScheduledStep,
    StepColumns,
    step_columns,
)
from vllm_piep.runtime.engine_core.warmup_shares import warmup_part
from vllm_piep.runtime.record import COLUMN

_STATIC = COLUMN["static"]
# Steps the log holds at most before a pass evaluates them.
MAX_UNEVALUATED = 16
# What the log holds, in order (the first element of each entry).
STEP_ENTRY, RELEASE_ENTRY, HOLD_ENTRY = 0, 1, 2


class Taken(NamedTuple):
    """A logged step, taken for its pass: what it computed, its time, when it was done."""

    step: RawStep | ScheduledStep
    step_ns: int
    now: int
    seq: int  # its number among the engine's steps (`steps` once it was counted)


class Mapped(NamedTuple):
    """A pass's steps as columns, mapped to their requests' slots."""

    columns: StepColumns
    slots: np.ndarray  # [M]
    prompt: np.ndarray  # [M] prompt lengths
    forget: set[str]  # released requests a step names late (`_forget_gone`)


class LogPass:
    """The log's pass (module docstring). A part of `EngineAccountant`
    (`accountant.py`), which sets up the state it uses."""

    table: RequestTable
    _log: list[tuple[Any, ...]]
    _log_steps: int

    def evaluate(self) -> None:
        """Sparse mode: evaluate the log (module docstring) in one pass. Its steps are
        converted and mapped to their slots together, and go to the predictor in one call; in
        prediction mode their shares are added as columns (`_apply_columns`), else step by
        step with each release and held output in the log's order (`_apply_in_order`). No
        slot is freed before the pass ends, so every step's requests keep the slots they were
        mapped to."""
        if not self._log:
            return
        log, self._log = self._log, []
        self._log_steps = 0
        self._oldest_hold_ns = None
        self._counts_changed = True
        taken: list[Taken | None] = []
        for entry in log:
            if entry[0] != STEP_ENTRY:
                continue
            _, (made, scheduled_ns), worker_step_ns, timer, now = entry
            try:
                step = made() if callable(made) else made
                step_ns = self._step_ns(scheduled_ns, worker_step_ns, timer, now)
                taken.append(Taken(step, step_ns, now, self.steps))
            except Exception as exc:  # boundary: one bad step must not lose the others
                self._deferred_failed("evaluating a step", exc)
                taken.append(None)
        self.steps_evaluated += len(taken)
        good = [t for t in taken if t is not None]
        self._evaluating = True
        try:
            columns = self._columns(good)
            if columns is not None and self.warmup.ready:
                predicted = self._predict_columns(good, columns)
                if predicted is not None:
                    self._apply_columns(log, taken, columns, *predicted)
                    return
            self._apply_in_order(log, taken, columns)
        finally:
            self._evaluating = False
            self._free_emptied()
            self._expire_gone()

    def _columns(self, taken: list[Taken]) -> Mapped | None:
        """The pass's steps as columns, each request mapped to its slot (new requests get
        theirs and their prompt lengths), or None where they cannot be (then each step is
        mapped alone: only a bad step loses its energy)."""
        if not taken or any(len(t.step.req_ids) == 0 for t in taken):
            return None
        try:
            columns = step_columns([t.step for t in taken])
            table, gone = self.table, self._gone
            known = table.slots
            ids = columns.req_ids
            forget: set[str] = set()
            for t in taken:  # new requests first: the lookups below then find every one
                for req_id in t.step.new_prompts:
                    if req_id not in known:
                        self._slot(req_id)
            try:
                slots = np.fromiter(map(known.__getitem__, ids), np.intp, len(ids))
            except KeyError:  # new requests (or a released one's late step): theirs first
                for req_id in dict.fromkeys(r for r in ids if r not in known):
                    if gone and req_id in gone:
                        forget.add(req_id)
                    self._slot(req_id)
                slots = np.fromiter(map(known.__getitem__, ids), np.intp, len(ids))
            for t in taken:
                for req_id, n in t.step.new_prompts.items():
                    table.prompt[known[req_id]] = n
            prompt = table.prompt[slots]
            for k, given in columns.given:
                prompt[columns.starts[k]:columns.starts[k] + len(given)] = given
        except Exception as exc:  # boundary
            self._deferred_failed("mapping steps", exc)
            return None
        return Mapped(columns, slots, prompt, forget)

    def _predict_columns(self, taken: list[Taken], mapped: Mapped
                         ) -> tuple[np.ndarray, np.ndarray] | None:
        """Every step's shares [M, N_OUT] and joules [C, K] from one `run_many` call, or
        None where the predictor has no step graph or the call failed."""
        if self.predictor is None or self._run_many is None:
            return None
        try:
            requests, joules = self._run_many(
                mapped.columns.sched, mapped.prompt,
                np.array([t.step_ns for t in taken]) / 1e9, mapped.columns.starts)
        except Exception:  # boundary: each step is then predicted alone
            return None
        return requests.T, joules

    def _apply_columns(self, log: list[tuple[Any, ...]], taken: list[Taken | None],
                       mapped: Mapped, shares: np.ndarray, joules: np.ndarray) -> None:
        """Every step's shares added, then each release and held output applied as of its
        place in the log: the shares of the steps after it are taken out of its row for it
        (they are what a dense engine adds after the release: unsent or after-finish energy,
        `_free_emptied`). Measured mode: each step waits for the meter instead (`_defer`),
        and the releases follow (its rows get energy only when a step is settled)."""
        columns, slots = mapped.columns, mapped.slots
        starts = columns.starts
        ends = np.append(starts[1:], len(slots))
        good = [t for t in taken if t is not None]
        totals = joules.sum(axis=0)  # non-negative parts: finite iff every part is
        tokens = np.add.reduceat(columns.sched[1], starts)
        rows = self.table.rows
        detector = self.warmup
        measured = self.splitter is not None
        added = 0.0
        for k, t in enumerate(good):
            a, b = starts[k], ends[k]
            if not math.isfinite(totals[k]):
                self._step_failed(ValueError(f"non-finite step energy {joules[:, k]}"),
                                  t.step, slots[a:b], forget=False)
                shares[a:b] = 0.0
                continue
            seconds = t.step_ns / 1e9
            excess = detector.excess_s(float(tokens[k]), seconds)
            detector.observe(float(tokens[k]), seconds - excess)
            warmup_j = 0.0
            if excess > 0.0:
                moved = warmup_part(shares[a:b], excess / seconds)
                shares[a:b] -= moved
                warmup_j = float(moved[:, _STATIC].sum())
                self._say_warmup(excess, seconds)
            if measured:
                self._seq = t.seq
                self._defer(t.step, slots[a:b], shares[a:b], warmup_j, float(totals[k]),
                            t.now - t.step_ns, t.now, forget=False)
            else:
                self.warmup_joules += warmup_j
                added += float(totals[k])
        if measured:
            self._release_in_order(log, mapped.forget)
            return
        self.total_joules += added
        # Each request's shares summed over the pass's steps, then added to its row once.
        order = np.argsort(slots, kind="stable")
        by_slot = slots[order]
        first = np.flatnonzero(np.concatenate(([True], by_slot[1:] != by_slot[:-1])))
        rows[by_slot[first], :N_OUT] += np.add.reduceat(shares[order], first, axis=0)
        # The releases and held outputs, each at its offset in the columns.
        last = np.full(len(rows), -1, dtype=np.intp)  # per slot, its last column
        last[by_slot] = order
        offset = 0
        forget = mapped.forget
        for entry, t in _walk(log, taken):
            kind = entry[0]
            if t is not None:
                offset += len(t.step.req_ids)
                if forget:
                    for req_id in forget.intersection(t.step.req_ids):
                        forget.discard(req_id)
                        self._release_at(offset, slots, shares, last, req_id,
                                         partial(self._forget, req_id))
            elif kind == RELEASE_ENTRY:
                self._release_at(offset, slots, shares, last, entry[1],
                                 partial(self._release_now, entry[1], entry[2]))
            else:
                self._release_at(offset, slots, shares, last, entry[2].request_id,
                                 partial(self._ready, entry[1], entry[2]))

    def _release_in_order(self, log: list[tuple[Any, ...]], forget: set[str]) -> None:
        """Measured mode: the log's releases, in order, after its steps went to the meter;
        then the released requests its steps named late."""
        for entry in log:
            if entry[0] == RELEASE_ENTRY:
                self._release_now(entry[1], entry[2])
            elif entry[0] == HOLD_ENTRY:
                self._ready(entry[1], entry[2])
        for req_id in forget:
            self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        """A released request a step named late (`_forget_gone`)."""
        gone = self._gone.get(req_id)
        self._release_now(req_id, aborted=gone is None or gone.aborted, final=True)

    def _release_at(self, offset: int, slots: np.ndarray, shares: np.ndarray,
                    last: np.ndarray, req_id: str, release: Callable[[], None]) -> None:
        """`release` run on the request's row as it was at `offset` of the columns (`last`:
        each slot's last column)."""
        slot = self.table.slots.get(req_id)
        later = None
        if slot is not None and last[slot] >= offset:
            mine = slots[offset:] == slot
            later = shares[offset:][mine].sum(axis=0)
            self.table.rows[slot, :N_OUT] -= later
        release()
        if later is not None:  # the emptied slot holds what the steps after added
            self.table.rows[slot, :N_OUT] += later

    def _apply_in_order(self, log: list[tuple[Any, ...]], taken: list[Taken | None],
                        mapped: Mapped | None) -> None:
        """Step by step in the log's order, with each release and held output between
        (measured mode, warm-up still judged, a predictor without a step graph): each step
        predicted from one `run_many` call where it can be, else alone."""
        good = [t for t in taken if t is not None]
        results: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(good)
        if mapped is not None:
            predicted = self._predict_columns(good, mapped)
            if predicted is not None:
                shares, joules = predicted
                ends = np.append(mapped.columns.starts[1:], len(mapped.slots))
                results = [(shares[a:b], joules[:, k])
                           for k, (a, b) in enumerate(zip(mapped.columns.starts, ends,
                                                          strict=True))]
        j = -1
        for entry, t in _walk(log, taken):
            kind = entry[0]
            if t is not None:
                j += 1
                self._seq = t.seq
                try:
                    step = t.step if isinstance(t.step, ScheduledStep) \
                        else ScheduledStep.of_raw(t.step)
                    slots = (mapped.slots[mapped.columns.starts[j]:][:len(step.req_ids)]
                             if mapped is not None else self._slots_of(step))
                    result = results[j]
                    if result is None:
                        self._predict_step(step, slots, t.step_ns, t.now)
                    else:
                        self._add_predicted(step, slots, result[0], result[1], t.step_ns,
                                            t.now)
                except Exception as exc:  # boundary
                    self._deferred_failed("evaluating a step", exc)
            elif kind == RELEASE_ENTRY:
                self._release_now(entry[1], entry[2])
            else:
                self._ready(entry[1], entry[2])


def _walk(log: list[tuple[Any, ...]], taken: list[Taken | None]
          ) -> Iterator[tuple[tuple[Any, ...], Taken | None]]:
    """The log's entries in order, each step with what was taken of it (steps that could not
    be taken are left out; other entries come with None)."""
    steps = iter(taken)
    for entry in log:
        if entry[0] != STEP_ENTRY:
            yield entry, None
        elif (t := next(steps)) is not None:
            yield entry, t
