"""The energy records' format on their way from the engine core to the API server.

Per batch of engine outputs (one `EngineCoreOutputs`), the first output carries, in
`kv_transfer_params`, the step header (`HEADER_KEY`: who predicted, the engine's totals) and
one bytes block (`ROWS_KEY`) with every output's request's running total, in the order of the
outputs: a float64 row each, ROW layout below. One block per batch rather than one field per
output: the engine core's loop is the serving bottleneck, and one `tobytes` costs far less
there than a dictionary per output; msgpack copies bytes as they are. The API server walks
the outputs in the same order (`RowCursor`), across the chunks vLLM splits a batch into.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vllm_piep.model.components import N_COMPONENTS
from vllm_piep.runtime.worker.steptime import STEP_TIMERS

HEADER_KEY = "piep_step"
ROWS_KEY = "piep_rows"
VERSION = 4
# Row layout: prefill J, decode J, one column per component, incomplete flag (1.0: a step of
# the request went unaccounted). The prefill and decode columns come first because the step
# graph's output rows start with them (accounting adds them in one block).
PREFILL, DECODE, FIRST_COMPONENT = 0, 1, 2
INCOMPLETE = FIRST_COMPONENT + N_COMPONENTS
ROW = INCOMPLETE + 1
ROW_BYTES = ROW * 8


@dataclass(frozen=True)
class StepHeader:
    """Who predicted, engine-wide totals, and the predictor's interval multipliers.

    engine_joules: predicted energy of every step so far; engine_errors: failed steps;
    unsent_joules: energy of requests the engine released before any output carried it (an
    abort between two outputs); tracked: requests the engine holds state for;
    after_finish_joules: energy of steps that ran after the request's final output went (with
    async scheduling a request that stops is already scheduled into the next step);
    steps_by_timer: the engine's steps so far by where their time came from
    (`STEP_TIMERS`: the worker's CUDA events, the worker's host clock, the engine's wall clock
    when no worker time arrived).
    """

    source: str
    bundle_id: str
    engine_id: str
    engine_joules: float
    engine_errors: int
    predictor_ok: bool
    unsent_joules: float = 0.0
    tracked: int = 0
    interval: tuple[float, float] | None = None  # multipliers of the predicted energy
    interval_level: float | None = None
    interval_coverage: float | None = None  # measured on held-out data
    after_finish_joules: float = 0.0
    steps_by_timer: tuple[int, ...] = (0,) * 3

    def encode(self) -> list:
        lo, hi = self.interval if self.interval is not None else (math.nan, math.nan)
        return [VERSION, self.source, self.bundle_id, self.engine_id, self.engine_joules,
                self.engine_errors, int(self.predictor_ok), self.unsent_joules, self.tracked,
                lo, hi, _nan(self.interval_level), _nan(self.interval_coverage),
                self.after_finish_joules, list(self.steps_by_timer)]

    @classmethod
    def decode(cls, raw: object) -> StepHeader:
        if (type(raw) is not list or len(raw) != 15 or raw[0] != VERSION
                or type(raw[14]) is not list or len(raw[14]) != len(STEP_TIMERS)):
            raise ValueError(f"unrecognised piep step header: {raw!r:.200}")
        lo, hi = float(raw[9]), float(raw[10])
        return cls(str(raw[1]), str(raw[2]), str(raw[3]), float(raw[4]), int(raw[5]),
                   bool(raw[6]), float(raw[7]), int(raw[8]),
                   None if math.isnan(lo) or math.isnan(hi) else (lo, hi),
                   _none(float(raw[11])), _none(float(raw[12])), float(raw[13]),
                   tuple(int(n) for n in raw[14]))


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def _none(x: float) -> float | None:
    return None if math.isnan(x) else x


def is_rows(blob: object) -> bool:
    return type(blob) is bytes and len(blob) % ROW_BYTES == 0


class RowCursor:
    """Walks one batch's rows block, output by output (vLLM hands a batch over in chunks)."""

    __slots__ = ("header", "_blob", "_next", "_end")

    def __init__(self, header: StepHeader | None, blob: bytes) -> None:
        self.header = header
        self._blob = blob
        self._next = 0
        self._end = len(blob)

    def take(self) -> bytes | None:
        """The next output's row; None once the block is used up."""
        start = self._next
        if start >= self._end:
            return None
        self._next = start + ROW_BYTES
        return self._blob[start:self._next]

    @property
    def left(self) -> int:
        return (self._end - self._next) // ROW_BYTES


@dataclass(frozen=True)
class WireRecord:
    """One request's cumulative energy, decoded."""

    source: str
    bundle_id: str
    complete: bool
    prefill_joules: float
    decode_joules: float
    components: tuple[float, ...]
    interval: tuple[float, float] | None = None
    interval_level: float | None = None
    interval_coverage: float | None = None

    @classmethod
    def from_wire(cls, header: StepHeader, blob: bytes) -> WireRecord:
        row = np.frombuffer(blob, dtype=np.float64).tolist()
        return cls(header.source, header.bundle_id,
                   header.predictor_ok and row[INCOMPLETE] == 0.0,
                   row[PREFILL], row[DECODE], tuple(row[FIRST_COMPONENT:INCOMPLETE]),
                   header.interval, header.interval_level, header.interval_coverage)

    def to_wire(self) -> bytes:
        """The row this record decodes from (tests and tools)."""
        row = [self.prefill_joules, self.decode_joules, *self.components,
               0.0 if self.complete else 1.0]
        return np.asarray(row, dtype=np.float64).tobytes()

    @property
    def joules(self) -> float:
        return math.fsum(self.components)
