"""The engine's per-request state, one slot per request: its row (the record's fields, then the
total an output last carried), its prompt length, the last step that named it, the slot's
generation, and its decode run's anchor. Plain Python lists: a step touches a few requests'
rows, and numpy's cost per call would exceed their arithmetic. A request's slot is found by its
id once per step of it; a released request's slot is reused (`free`), never shrunk. The table
is the only writer of the rows and of where the energy no output carried went (`Outcomes`).
No vLLM imports."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_piep.predict.stepgraph import N_OUT
from vllm_piep.runtime.record import COLUMN, ROW_FIELDS, encode_rows

FIELDS = len(ROW_FIELDS)
SENT = FIELDS  # the column after the record's fields: the total an output carried
# Rows of aborted requests kept for the next header's counts (`take_aborted`); beyond these
# their energy is in the totals only.
MAX_ABORTED_ROWS = 4096
COLUMNS = SENT + 1
ZERO_SLOT = 0  # row 0 stays zero: requests the engine has no step for yet
_PREFILL, _DECODE, _INCOMPLETE = COLUMN["prefill"], COLUMN["decode"], COLUMN["incomplete"]
FIRST = _DECODE + 1  # the first component column
ALL_OUTPUTS = tuple(range(N_OUT))  # a share of every output field (the step graph's)


@dataclass(slots=True)
class Outcomes:
    """The engine's energy, cumulative, J: of every step, and of it what no output carried."""

    step_joules: float = 0.0  # every step the engine accounted
    unsent: float = 0.0  # steps of requests aborted from outside, after their last output
    aborted: float = 0.0  # requests aborted from outside that no output carried (sparse)
    after_finish: float = 0.0  # steps run after a request's final output
    warmup: float = 0.0  # one-off work inside steps, billed to no request


class RequestTable:
    """Slots of requests; `rows`, `prompt`, `last_seq`, `generation` and the run anchors are
    lists indexed by slot."""

    def __init__(self) -> None:
        self.outcomes = Outcomes()
        # Requests aborted with energy no output carried, and their rows, since the counts
        # last went out (`take_aborted`).
        self.aborted_ids: list[str] = []
        self.aborted_rows: list[list[float]] = []
        self.slots: dict[str, int] = {}
        self.free: list[int] = []
        self.rows: list[list[float]] = [[0.0] * COLUMNS]
        self.prompt: list[float] = [0.0]
        self.last_seq: list[int] = [0]  # per slot: the last step naming it
        # Per slot: how many times it was emptied (a step waiting for the meter settles into
        # its slot only while the slot still holds the same request).
        self.generation: list[int] = [0]
        # Per slot, a request in a run of decode steps (`decode_runs.py`): the run's anchor step
        # (the engine's step count, from 0) and the request's context then; measured mode: the
        # step its predicted joules start from.
        self.run_j0: list[int] = [0]
        self.run_s0: list[int] = [0]
        self.run_p0: list[int] = [0]

    def __len__(self) -> int:
        return len(self.slots)

    def slot(self, req_id: str) -> int:
        """The request's slot (a new one for a request not seen yet)."""
        slot = self.slots.get(req_id)
        if slot is None:
            if self.free:
                slot = self.free.pop()
            else:
                slot = len(self.rows)
                self.rows.append([0.0] * COLUMNS)
                for column in (self.prompt, self.last_seq, self.generation, self.run_j0,
                               self.run_s0, self.run_p0):
                    column.append(0)
                self.prompt[slot] = 0.0
            self.slots[req_id] = slot
        return slot

    def slots_of(self, req_ids: Iterable[str]) -> list[int]:
        """The requests' slots (new requests get theirs)."""
        get = self.slots.get
        return [s if (s := get(r)) is not None else self.slot(r) for r in req_ids]

    def add(self, slots: Sequence[int], shares: Sequence[Sequence[float]],
            columns: Sequence[int] = ALL_OUTPUTS, scale: float = 1.0) -> None:
        """Each share (its values into `columns` of its slot's row, times `scale`) added (a
        request appears once among `slots`)."""
        rows = self.rows
        if scale == 1.0:
            for slot, share in zip(slots, shares, strict=True):
                row = rows[slot]
                for column, value in zip(columns, share, strict=True):
                    row[column] += value
        else:
            for slot, share in zip(slots, shares, strict=True):
                row = rows[slot]
                for column, value in zip(columns, share, strict=True):
                    row[column] += scale * value

    def mark_incomplete(self, slots: Iterable[int]) -> None:
        rows = self.rows
        for slot in slots:
            rows[slot][_INCOMPLETE] = 1.0

    def encode(self, req_ids: Sequence[str]) -> bytes:
        """These requests' rows as one block, marked as carried by an output."""
        get, rows = self.slots.get, self.rows
        block = array("d")
        for req_id in req_ids:
            slot = get(req_id)
            if slot is None:
                block.extend(rows[ZERO_SLOT][:FIELDS])
                continue
            row = rows[slot]
            row[SENT] = row[_PREFILL] + row[_DECODE]
            block.extend(row[:FIELDS])
        return encode_rows(block)

    def row(self, req_id: str) -> list[float]:
        """A request's row (the record's fields; zeros for a request without a slot)."""
        slot = self.slots.get(req_id, ZERO_SLOT)
        return self.rows[slot][:FIELDS]

    def close(self, req_id: str, aborted: bool, no_output: bool) -> float | None:
        """The request's slot emptied and freed; the energy no output carried counted
        (`Outcomes`): warm-up taken back after an output carried it, aborted (`no_output`:
        none of the request's outputs carried a row), unsent (aborted after one did), or
        after-finish. Its prompt length; None for a request without a slot."""
        slot = self.slots.pop(req_id, None)
        if slot is None:
            return None
        row = self.rows[slot]
        left = row[_PREFILL] + row[_DECODE] - row[SENT]
        outcomes = self.outcomes
        if left < 0.0:
            # Warm-up energy taken back after an output had carried it: the API server counts
            # the request by that output, so it is not warm-up after all.
            outcomes.warmup += left
        elif aborted:
            if no_output:
                outcomes.aborted += left
            else:
                outcomes.unsent += left
            if left > 0.0 and len(self.aborted_ids) < MAX_ABORTED_ROWS:
                self.aborted_ids.append(req_id)
                self.aborted_rows.append(row[:FIELDS])
        else:
            outcomes.after_finish += left
        prompt = self.prompt[slot]
        # The slot emptied (its row, prompt and step zeroed) and freed.
        self.rows[slot] = [0.0] * COLUMNS
        self.last_seq[slot] = 0
        self.prompt[slot] = 0.0
        self.generation[slot] += 1
        self.free.append(slot)
        return prompt

    def take_aborted(self) -> tuple[tuple[str, ...], bytes]:
        """The aborted requests' ids and rows since the last call (the counts going out)."""
        if not self.aborted_ids:
            return (), b""
        block = array("d")
        for row in self.aborted_rows:
            block.extend(row)
        ids = tuple(self.aborted_ids)
        self.aborted_ids, self.aborted_rows = [], []
        return ids, encode_rows(block)
