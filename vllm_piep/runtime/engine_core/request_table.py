"""The engine's per-request state, as columns: one row per request slot of a preallocated
matrix (the record's fields, then the total an output last carried), the request's prompt
length, the last step that named it, the slot's generation, and its decode run's anchor. A
request's slot is found by its id once per step of it; a released request's slot is reused
(`free`), never shrunk. The table is the only writer of the rows and of where the energy no
output carried went (`Outcomes`). No vLLM imports."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_piep.predict.stepgraph import N_OUT
from vllm_piep.runtime.record import COLUMN, ROW_FIELDS, encode_rows

SENT = len(ROW_FIELDS)  # the column after the record's fields: the total an output carried
# Rows of aborted requests kept for the next header's counts (`take_aborted`); beyond these
# their energy is in the totals only.
MAX_ABORTED_ROWS = 4096
COLUMNS = SENT + 1
ZERO_SLOT = 0  # row 0 stays zero: requests the engine has no step for yet
_PREFILL, _DECODE, _INCOMPLETE = COLUMN["prefill"], COLUMN["decode"], COLUMN["incomplete"]
_FIRST = _DECODE + 1  # the first component column


@dataclass(slots=True)
class Outcomes:
    """The engine's energy, cumulative, J: of every step, and of it what no output carried."""

    step_joules: float = 0.0  # every step the engine accounted
    unsent: float = 0.0  # steps of requests aborted from outside, after their last output
    aborted: float = 0.0  # requests aborted from outside that no output carried (sparse)
    after_finish: float = 0.0  # steps run after a request's final output
    warmup: float = 0.0  # one-off work inside steps, billed to no request


class RequestTable:
    """Slots of requests; `rows`, `prompt` and `last_seq` are indexed by slot."""

    def __init__(self) -> None:
        self.outcomes = Outcomes()
        # Requests aborted with energy no output carried, and their rows, since the counts
        # last went out (`take_aborted`).
        self.aborted_ids: list[str] = []
        self.aborted_rows: list[np.ndarray] = []
        self.slots: dict[str, int] = {}
        self.free: list[int] = []
        self.rows = np.zeros((1, COLUMNS))
        self.prompt = np.zeros(1)
        self.last_seq = np.zeros(1, dtype=np.int64)  # per slot: the last step naming it
        # Per slot: how many times it was emptied (a step waiting for the meter settles into
        # its slot only while the slot still holds the same request).
        self.generation = np.zeros(1, dtype=np.int64)
        # Per slot, a request in a run of decode steps (`decode_runs.py`): the run's anchor
        # step and the request's context then.
        self.run_j0 = np.zeros(1)
        self.run_s0 = np.zeros(1)
        self.run_p0 = np.zeros(1)  # measured mode: the step its predicted joules start from

    def __len__(self) -> int:
        return len(self.slots)

    def slot(self, req_id: str) -> int:
        """The request's slot, a new one (growing the arrays, which replaces them: index them
        afterwards) for a request not seen yet."""
        slot = self.slots.get(req_id)
        if slot is None:
            if not self.free:
                old = self.rows.shape[0]
                grow = max(16, old)
                self.rows = np.vstack([self.rows, np.zeros((grow, COLUMNS))])
                self.prompt = np.concatenate([self.prompt, np.zeros(grow)])
                self.last_seq = np.concatenate([self.last_seq, np.zeros(grow, dtype=np.int64)])
                self.generation = np.concatenate([self.generation,
                                                  np.zeros(grow, dtype=np.int64)])
                self.run_j0 = np.concatenate([self.run_j0, np.zeros(grow)])
                self.run_s0 = np.concatenate([self.run_s0, np.zeros(grow)])
                self.run_p0 = np.concatenate([self.run_p0, np.zeros(grow)])
                self.free.extend(range(self.rows.shape[0] - 1, old - 1, -1))
            slot = self.free.pop()
            self.slots[req_id] = slot
        return slot

    def slots_of(self, req_ids: list[str]) -> np.ndarray:
        """The requests' slots, as an index array (new requests get theirs)."""
        try:
            return np.fromiter(map(self.slots.__getitem__, req_ids), np.intp, len(req_ids))
        except KeyError:  # new requests: may grow the arrays, so index them afterwards
            return np.fromiter(map(self.slot, req_ids), np.intp, len(req_ids))

    def add(self, slots: np.ndarray, shares: np.ndarray) -> None:
        """Shares [len(slots), N_OUT] into the rows (a request appears once among `slots`)."""
        self.rows[slots, :N_OUT] += shares

    def add_decode(self, slots: np.ndarray, parts: np.ndarray) -> None:
        """Decode joules per component [len(slots), C] into the rows."""
        rows = self.rows
        rows[slots, _FIRST:_FIRST + parts.shape[1]] += parts
        rows[slots, _DECODE] += parts.sum(axis=1)

    def add_column(self, slots: np.ndarray, column: int, values: np.ndarray) -> None:
        """Measured mode's `predicted` or `unmeasured` joules into the rows."""
        self.rows[slots, column] += values

    def mark_incomplete(self, slots: np.ndarray) -> None:
        self.rows[slots, _INCOMPLETE] = 1.0

    def encode(self, req_ids: list[str]) -> bytes:
        """These requests' rows as one block, marked as carried by an output."""
        get = self.slots.get
        slots = np.fromiter((get(r, ZERO_SLOT) for r in req_ids), np.intp, len(req_ids))
        block = self.rows[slots]
        self.rows[slots, SENT] = block[:, _PREFILL] + block[:, _DECODE]
        self.rows[ZERO_SLOT] = 0.0
        return encode_rows(block)

    def close(self, req_id: str, aborted: bool, no_output: bool) -> float | None:
        """The request's slot emptied and freed; the energy no output carried counted
        (`Outcomes`): warm-up taken back after an output carried it, aborted (`no_output`:
        none of the request's outputs carried a row), unsent (aborted after one did), or
        after-finish. Its prompt length; None for a request without a slot."""
        slot = self.slots.pop(req_id, None)
        if slot is None:
            return None
        row = self.rows[slot]
        left = float(row[_PREFILL] + row[_DECODE] - row[SENT])
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
                self.aborted_rows.append(row[:SENT].copy())
        else:
            outcomes.after_finish += left
        prompt = float(self.prompt[slot])
        self.reset(slot)
        self.free.append(slot)
        return prompt

    def take_aborted(self) -> tuple[tuple[str, ...], bytes]:
        """The aborted requests' ids and rows since the last call (the counts going out)."""
        if not self.aborted_ids:
            return (), b""
        ids, rows = tuple(self.aborted_ids), encode_rows(np.vstack(self.aborted_rows))
        self.aborted_ids, self.aborted_rows = [], []
        return ids, rows

    def reset(self, slot: int) -> None:
        """A slot emptied: its row, prompt and step zeroed (it is freed by the caller)."""
        self.rows[slot] = 0.0
        self.last_seq[slot] = 0
        self.prompt[slot] = 0.0
        self.generation[slot] += 1
