"""The energy record's format on its way from the engine core to the API server.

Each engine output of a request carries that request's running total as raw bytes
(`kv_transfer_params["piep"]`: float64 row, ROW_LAYOUT below); the first output of each batch
also carries the step header (`kv_transfer_params["piep_step"]`: who predicted, and the
engine's totals). Bytes because a numpy block sliced into per-request bytes costs far less on
the engine's critical path than lists of Python floats, and msgpack copies bytes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_piep.components import N_COMPONENTS

RECORD_KEY = "piep"
HEADER_KEY = "piep_step"
VERSION = 2
# Row layout: prefill J, decode J, incomplete flag (1.0: a step of the request went
# unaccounted), then one column per component.
PREFILL, DECODE, INCOMPLETE, FIRST_COMPONENT = 0, 1, 2, 3
ROW = FIRST_COMPONENT + N_COMPONENTS
ROW_BYTES = ROW * 8


@dataclass(frozen=True)
class StepHeader:
    """Who predicted, and engine-wide totals: predicted step joules and failed steps so far."""

    source: str
    bundle_id: str
    engine_id: str
    engine_joules: float
    engine_errors: int
    predictor_ok: bool

    def encode(self) -> list:
        return [VERSION, self.source, self.bundle_id, self.engine_id, self.engine_joules,
                self.engine_errors, int(self.predictor_ok)]

    @classmethod
    def decode(cls, raw: object) -> StepHeader:
        if type(raw) is not list or len(raw) != 7 or raw[0] != VERSION:
            raise ValueError(f"unrecognised piep step header: {raw!r:.200}")
        return cls(str(raw[1]), str(raw[2]), str(raw[3]), float(raw[4]), int(raw[5]),
                   bool(raw[6]))


def is_row(blob: object) -> bool:
    return type(blob) is bytes and len(blob) == ROW_BYTES


@dataclass(frozen=True)
class WireRecord:
    """One request's cumulative energy, decoded."""

    source: str
    bundle_id: str
    complete: bool
    prefill_joules: float
    decode_joules: float
    components: tuple[float, ...]

    @classmethod
    def from_wire(cls, header: StepHeader, blob: bytes) -> WireRecord:
        row = np.frombuffer(blob, dtype=np.float64).tolist()
        return cls(header.source, header.bundle_id,
                   header.predictor_ok and row[INCOMPLETE] == 0.0,
                   row[PREFILL], row[DECODE], tuple(row[FIRST_COMPONENT:]))

    def to_wire(self) -> bytes:
        """The row this record decodes from (tests and tools)."""
        row = [self.prefill_joules, self.decode_joules, 0.0 if self.complete else 1.0,
               *self.components]
        return np.asarray(row, dtype=np.float64).tobytes()

    @property
    def joules(self) -> float:
        return float(sum(self.components))
