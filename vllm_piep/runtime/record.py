"""The one record that travels engine core -> API server: its named layout, its encoding, its
decoding. Nothing else knows the layout (the worker's step time rides on vLLM's
`ModelRunnerOutput` as two attributes: `runtime/worker/step.py`).

Per batch of engine outputs (one `EngineCoreOutputs`), the first output carries, in
`kv_transfer_params`, the step header (`HEADER_KEY`: who predicted, the engine's totals; a
msgspec struct, msgpack-encoded) and one bytes block (`ROWS_KEY`) with the running totals of the
outputs' requests, in the order of the outputs: one `ROW_DTYPE` record each. Every output has
one, unless `PICKS_KEY` lists (int32, ascending) the positions in the batch of the outputs that
have: a sparse engine's (`engine_core/accountant.py`) finishing outputs and those of requests
the API server may finish itself. A batch with neither rows nor new counts carries nothing.
One block per batch rather than one field per output: the engine core's loop is the serving
bottleneck, and one `tobytes` costs far less there than a dictionary per output; msgpack copies
bytes as they are. The API server walks the outputs in the same order (`RowCursor`), across the
chunks vLLM splits a batch into.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import get_args

import msgspec
import numpy as np

from vllm_piep.meters.common import Source as MeterSource
from vllm_piep.model.components import COMPONENTS
from vllm_piep.predict.base import Source as PredictorSource
from vllm_piep.predict.stepgraph import OUTPUT_FIELDS
from vllm_piep.runtime.worker.steptime import STEP_TIMERS

HEADER_KEY = "piep_step"
ROWS_KEY = "piep_rows"
PICKS_KEY = "piep_picks"
PICK_DTYPE = np.dtype("<i4")
VERSION = 13
# A request's running total: what the step graph returns per request (prefill J, decode J, one
# per component, in that order), then a flag: 1.0 when a step of the request went unaccounted.
# In measured mode (the header names a meter) the energies are measured ones, and two more
# fields follow: the model's own prediction of the same steps, and the part of that prediction
# whose steps the meter could not speak for (settled by the fit instead); both 0 otherwise.
ROW_FIELDS = (*OUTPUT_FIELDS, "incomplete", "predicted", "unmeasured")
# Every `usage.energy.source` a response can carry: a predictor's (prediction mode), a meter's
# (measured mode), `fitted` (measured mode, some steps settled by the fit: `from_wire`) and
# `mixed` (a response's requests differ: `api_server/ledger.py`). docs/architecture.md
# describes each, once.
RESPONSE_SOURCES: tuple[str, ...] = tuple(dict.fromkeys(
    (*get_args(PredictorSource), *get_args(MeterSource), "fitted", "mixed")))
ROW_DTYPE = np.dtype([(name, "<f8") for name in ROW_FIELDS])
_BIG_ENDIAN = sys.byteorder == "big"
ROW_BYTES = ROW_DTYPE.itemsize
COLUMN = {name: i for i, name in enumerate(ROW_FIELDS)}  # the fields as matrix columns
assert OUTPUT_FIELDS[2:] == COMPONENTS


def encode_rows(rows: array) -> bytes:
    """Rows of `len(ROW_FIELDS)` doubles each, one after another in ROW_FIELDS order (an
    `array("d")`), as a rows block (little-endian)."""
    if _BIG_ENDIAN:
        rows = array("d", rows)
        rows.byteswap()
    return rows.tobytes()


def decode_row(blob: bytes) -> np.void:
    """One request's row, its fields by name."""
    return np.frombuffer(blob, dtype=ROW_DTYPE)[0]


class StepHeader(msgspec.Struct, frozen=True, array_like=True):
    """Who predicted, the predictor's interval multipliers, and what the engine counted; on
    the first output of a batch that carries rows or new counts (`kv_transfer_params`).

    The counts are increments since the engine last sent counts, and an engine sends each
    increment once, to one API server process (the others get zeros), so that /metrics summed
    over API server processes counts every joule once. States (`tracked`, `ratios`,
    `meter_note`, `meter_shared`) are not increments. The fields are positional on the wire
    (`array_like`): new ones go last, with `VERSION` raised.
    """

    # The predictor's source: prior, calibrated, estimated, simulated; in measured mode the meter's:
    # measured, estimated, simulated, fitted ("none": no predictor could load).
    source: str
    bundle_id: str  # the calibrated bundle's id, or the prior's name
    engine_id: str  # the engine core's index (data parallel rank)
    # Energy of the engine's steps (measured mode: the meter's, split to the steps), J.
    step_joules: float
    errors: int  # steps that failed to be accounted
    predictor_ok: bool  # False: no predictor; the responses carry no usage.energy
    # Energy of requests released from outside before any output carried it, J.
    unsent_joules: float = 0.0
    tracked: int = 0  # requests the engine holds state for (a state)
    interval: tuple[float, float] | None = None  # multipliers of the predicted energy
    interval_level: float | None = None  # the interval's nominal level
    interval_coverage: float | None = None  # its coverage measured on held-out data
    # Energy of steps run after a request's final output went (async scheduling already put
    # a stopping request into the next step), J.
    after_finish_joules: float = 0.0
    # Energy of requests aborted from outside whose outputs carried no row (a sparse engine's
    # rows go on finishing outputs only), J.
    aborted_joules: float = 0.0
    steps_by_timer: tuple[int, ...] = (0,) * len(STEP_TIMERS)  # steps, by `STEP_TIMERS`
    warmup_joules: float = 0.0  # one-off work inside steps, billed to no request, J
    carries_counts: bool = False  # the one header an increment went out on (others: zeros)
    meter: str | None = None  # measured mode: the meter's name (None: prediction mode)
    predicted_joules: float = 0.0  # measured mode: the model's figure for the same steps, J
    idle_joules: float = 0.0  # measured mode: the meter's energy while no step ran, J
    fitted_joules: float = 0.0  # measured mode: steps the meter could not speak for, J
    fallback_steps: int = 0  # measured mode: those steps, settled by the fit
    # Measured mode: of the meter's energy, what its readings estimated rather than read (a
    # worker's meter that cannot be read, estimated from the others'), J.
    estimated_joules: float = 0.0
    # Measured mode: the fit's measured/predicted ratios of static and dynamic energy (a
    # state).
    ratios: tuple[float, float] | None = None
    # Why the engine is not in measured mode (no meter measures here, `measured: false`, the
    # meter failed to open, its workers span nodes...; None: it is, or has not tried yet; a
    # state).
    meter_note: str | None = None
    # Measured mode: others' processes seen on the metered GPUs at the last look (0: none;
    # -1: NVML cannot tell, e.g. another PID namespace; a state).
    meter_shared: int = 0
    # Steps whose closed form an explicit check disagreed with (the engine then splits every
    # step explicitly; `engine_core/accountant.py`).
    audit_failures: int = 0
    zero_time_steps: int = 0  # steps of no measured time, priced as their work alone
    # Requests aborted from outside since the counts last went out, with energy no output
    # carried (in `unsent_joules` or `aborted_joules`): their ids and cumulative rows (a rows
    # block), so that the billing ledger books it to them (at most `MAX_ABORTED_ROWS`).
    aborted_ids: tuple[str, ...] = ()
    aborted_rows: bytes = b""
    version: int = VERSION  # the wire format's version (`VERSION`)

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, raw: object) -> StepHeader:
        """ValueError for anything but a header of this version."""
        if type(raw) is not bytes:
            raise ValueError(f"unrecognised piep step header: {raw!r:.200}")
        try:
            header = _DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise ValueError(f"unrecognised piep step header: {exc}") from exc
        if header.version != VERSION:
            raise ValueError(f"piep step header version {header.version}, expected {VERSION}")
        return header

    def replace(self, **changes: object) -> StepHeader:
        return msgspec.structs.replace(self, **changes)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepHeader)


def is_rows(blob: object) -> bool:
    return type(blob) is bytes and len(blob) % ROW_BYTES == 0


class RowCursor:
    """Walks one batch's rows block, output by output (vLLM hands a batch over in chunks);
    with `picks`, only the outputs at those positions have a row."""

    __slots__ = ("header", "_blob", "_next", "_end", "_picks", "_seen", "_pick")

    def __init__(self, header: StepHeader | None, blob: bytes, picks: bytes | None = None
                 ) -> None:
        self.header = header
        self._blob = blob
        self._next = 0
        self._end = len(blob)
        self._picks = None if picks is None else np.frombuffer(picks, PICK_DTYPE).tolist()
        self._seen = 0  # outputs walked
        self._pick = 0  # the next entry of `picks`

    def take(self) -> bytes | None:
        """The next output's row; None if it has none (or the block is used up)."""
        start = self._next
        if start >= self._end:
            return None
        picks = self._picks
        if picks is not None:
            position = self._seen
            self._seen = position + 1
            if self._pick >= len(picks) or picks[self._pick] != position:
                return None
            self._pick += 1
        self._next = start + ROW_BYTES
        return self._blob[start:self._next]

    @property
    def left(self) -> int:
        return (self._end - self._next) // ROW_BYTES


def encode_picks(positions: list[int]) -> bytes:
    """Positions as little-endian int32 (`PICK_DTYPE`)."""
    return struct.pack(f"<{len(positions)}i", *positions)


def is_picks(blob: object, rows: int) -> bool:
    return type(blob) is bytes and len(blob) == rows * PICK_DTYPE.itemsize


@dataclass(frozen=True)
class WireRecord:
    """One request's cumulative energy, decoded."""

    source: str  # the header's (`StepHeader.source`)
    bundle_id: str  # the header's (`StepHeader.bundle_id`)
    complete: bool  # False: a step of the request went unaccounted (no usage.energy)
    prefill_joules: float  # the request's energy in steps that computed its prompt, J
    decode_joules: float  # and in steps that generated its tokens, J
    components: tuple[float, ...]  # its energy by component (`model.components.COMPONENTS`), J
    interval: tuple[float, float] | None = None  # the header's multipliers of the energy
    interval_level: float | None = None  # the interval's nominal level
    interval_coverage: float | None = None  # its coverage measured on held-out data
    meter: str | None = None  # measured mode: the meter, and the model's figure beside it
    predicted_joules: float | None = None  # measured mode: the model's figure, J
    # Of predicted_joules, what the meter did not measure: steps settled by the fit, and the
    # estimated part of a reading (a worker's meter that cannot be read).
    unmeasured_joules: float = 0.0
    meter_shared: int = 0  # the header's (`StepHeader.meter_shared`)

    @classmethod
    def from_wire(cls, header: StepHeader, blob: bytes) -> WireRecord:
        row = decode_row(blob)
        measured = header.meter is not None
        unmeasured = float(row["unmeasured"]) if measured else 0.0
        return cls("fitted" if unmeasured > 0.0 else header.source, header.bundle_id,
                   header.predictor_ok and float(row["incomplete"]) == 0.0,
                   float(row["prefill"]), float(row["decode"]),
                   tuple(float(row[name]) for name in COMPONENTS),
                   header.interval, header.interval_level, header.interval_coverage,
                   header.meter, float(row["predicted"]) if measured else None, unmeasured,
                   header.meter_shared if measured else 0)

    def to_wire(self) -> bytes:
        """The row this record decodes from (tests and tools)."""
        row = np.zeros(1, dtype=ROW_DTYPE)
        row["prefill"], row["decode"] = self.prefill_joules, self.decode_joules
        for name, joules in zip(COMPONENTS, self.components, strict=True):
            row[name] = joules
        row["incomplete"] = 0.0 if self.complete else 1.0
        row["predicted"] = self.predicted_joules or 0.0
        row["unmeasured"] = self.unmeasured_joules
        return row.tobytes()

    @property
    def joules(self) -> float:
        return math.fsum(self.components)
