"""The engine's per-request state, as columns: one row per request slot of a preallocated
matrix (the record's fields, then the total an output last carried), the request's prompt
length, the last step that named it, the slot's generation, and its decode run's anchor. A
request's slot is found by its id once per step of it; a released request's slot is reused
(`free`), never shrunk. No vLLM imports."""

from __future__ import annotations

import numpy as np

from vllm_piep.runtime.record import ROW_FIELDS

SENT = len(ROW_FIELDS)  # the column after the record's fields: the total an output carried
COLUMNS = SENT + 1
ZERO_SLOT = 0  # row 0 stays zero: requests the engine has no step for yet


class RequestTable:
    """Slots of requests; `rows`, `prompt` and `last_seq` are indexed by slot."""

    def __init__(self) -> None:
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

    def reset(self, slot: int) -> None:
        """A slot emptied: its row, prompt and step zeroed (it is freed by the caller)."""
        self.rows[slot] = 0.0
        self.last_seq[slot] = 0
        self.prompt[slot] = 0.0
        self.generation[slot] += 1
