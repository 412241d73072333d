"""Engine-side energy accounting: predict each step, split it among the step's requests, keep
each request's running total, and encode it for the trip to the API server. No vLLM imports:
`hooks/engine.py` feeds it plain numbers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from vllm_piep.components import N_COMPONENTS
from vllm_piep.flops import StepBatch
from vllm_piep.predict.attribution import prefill_fraction, split_step
from vllm_piep.predict.base import Predictor, StepInput

logger = logging.getLogger("vllm.plugins.piep")

RECORD_KEY = "piep"  # key in EngineCoreOutput.kv_transfer_params; popped before vLLM sees it
RECORD_VERSION = 1
# Layout of a request's running-total row: prefill J, decode J, then one column per component.
_PREFILL, _DECODE, _FIRST_COMPONENT = 0, 1, 2
_ROW = _FIRST_COMPONENT + N_COMPONENTS
_MAX_PENDING_STEPS = 64  # scheduled but not yet updated steps (async scheduling, PP batch queue)
_ZERO_SLOT = 0
RECORD_LEN = 7 + _ROW


def is_record(raw: object) -> bool:
    """Cheap shape check of an encoded record (the API server runs it for every output)."""
    return type(raw) is list and len(raw) == RECORD_LEN and raw[0] == RECORD_VERSION


@dataclass(frozen=True)
class WireRecord:
    """One request's cumulative energy as it travels from the engine core to the API server.

    Engine-wide totals ride along so that the API server can export them: the sum of predicted
    step energies and the number of steps the predictor failed on, for engine `engine_id`.
    """

    source: str
    bundle_id: str
    engine_id: str
    engine_joules: float
    engine_errors: int
    complete: bool
    prefill_joules: float
    decode_joules: float
    components: tuple[float, ...]

    def encode(self) -> list:
        return [RECORD_VERSION, self.source, self.bundle_id, self.engine_id, self.engine_joules,
                self.engine_errors, int(self.complete), self.prefill_joules, self.decode_joules,
                *self.components]

    @classmethod
    def decode(cls, raw: list) -> "WireRecord":
        if not is_record(raw):
            raise ValueError(f"unrecognised piep energy record: {raw!r}")
        return cls(str(raw[1]), str(raw[2]), str(raw[3]), float(raw[4]), int(raw[5]),
                   bool(raw[6]), float(raw[7]), float(raw[8]), tuple(float(x) for x in raw[9:]))

    @property
    def joules(self) -> float:
        return float(sum(self.components))


class OnceLogger:
    """Logs each distinct failure once, so a broken predictor cannot flood the server log."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def warn(self, where: str, exc: BaseException, consequence: str) -> None:
        key = (where, type(exc).__name__)
        if key in self._seen:
            return
        self._seen.add(key)
        logger.warning("vllm_piep: %s failed (%s: %s); %s. Serving continues; further "
                       "failures of this kind are counted in piep_predictor_errors_total, "
                       "not logged.", where, type(exc).__name__, exc, consequence,
                       exc_info=exc)


class EngineAccountant:
    """Per engine core: step predictions, per-request running totals, engine totals."""

    def __init__(self, make_predictor: Callable[[], Predictor], engine_id: str = "0",
                 clock_ns: Callable[[], int] = time.perf_counter_ns) -> None:
        self._make_predictor = make_predictor
        self._predictor: Predictor | None = None
        self._predictor_failed = False
        self.engine_id = engine_id
        self._clock_ns = clock_ns
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._rows = np.zeros((1, _ROW))  # row 0 stays zero: requests without a step yet
        self._incomplete: set[str] = set()
        self._pending: dict[int, tuple[list[str], StepBatch, int]] = {}
        self._last_done_ns: int | None = None
        self.total_joules = 0.0
        self.errors = 0
        self.steps = 0
        self._once = OnceLogger()

    # -- predictor ---------------------------------------------------------------------------
    @property
    def predictor(self) -> Predictor | None:
        if self._predictor is None and not self._predictor_failed:
            try:
                self._predictor = self._make_predictor()
            except Exception as exc:  # boundary: a bad predictor must not stop serving
                self._predictor_failed = True
                self.errors += 1
                self._once.warn("loading the energy predictor", exc,
                                "responses will carry no usage.energy")
        return self._predictor

    # -- per step ----------------------------------------------------------------------------
    def on_schedule(self, key: int, req_ids: list[str], batch: StepBatch) -> None:
        """A step was scheduled; its work is known now, its duration when it is done."""
        if len(self._pending) >= _MAX_PENDING_STEPS:  # never grows without bound
            self._pending.pop(next(iter(self._pending)))
        self._pending[key] = (req_ids, batch, self._clock_ns())

    def on_step_done(self, key: int, worker_step_ns: int | None = None) -> None:
        """The step's model output arrived: predict it and add each request's share.

        The step time is the worker's (where the model ran) when it sent one; else the engine's
        wall time since the step could start: after it was scheduled and after the previous
        step finished (with async scheduling they overlap; this keeps the steps disjoint).
        """
        pending = self._pending.pop(key, None)
        now = self._clock_ns()
        if pending is None:
            return
        req_ids, batch, scheduled_ns = pending
        start = scheduled_ns if self._last_done_ns is None else max(scheduled_ns,
                                                                    self._last_done_ns)
        self._last_done_ns = now
        step_ns = worker_step_ns if worker_step_ns is not None else now - start
        if self.steps == 0:
            logger.info("vllm_piep: step times from the %s", "worker's timer around the model"
                        if worker_step_ns is not None else "engine's wall clock (the worker "
                        "sent none)")
        self.steps += 1
        predictor = self.predictor
        try:
            if predictor is None:
                raise RuntimeError("no predictor")
            step = predictor.predict_step(StepInput(batch=batch, step_seconds=step_ns / 1e9))
            per_request = split_step(step)
        except Exception as exc:  # boundary
            if predictor is not None:
                self.errors += 1
                self._once.warn("predicting a step's energy", exc,
                                "the requests in that step get no usage.energy")
            self._incomplete.update(req_ids)
            return
        increment = np.empty((len(req_ids), _ROW))
        increment[:, _FIRST_COMPONENT:] = per_request
        total = per_request.sum(axis=1)
        np.multiply(total, prefill_fraction(batch), out=increment[:, _PREFILL])
        np.subtract(total, increment[:, _PREFILL], out=increment[:, _DECODE])
        slots = [self._slot(r) for r in req_ids]
        self._rows[slots] += increment  # a request appears once per step: no index repeats
        self.total_joules += float(step.joules.sum())

    # -- per request -------------------------------------------------------------------------
    def encode_records(self, req_ids: list[str]) -> list[list]:
        """Wire records (see `WireRecord.encode`) of these requests, built in one pass."""
        predictor = self._predictor
        if predictor is None:
            source, bundle = "none", "none"
        else:
            source, bundle = predictor.source, predictor.bundle_id
        header = [RECORD_VERSION, source, bundle, self.engine_id, self.total_joules, self.errors]
        slots = self._slots
        rows = self._rows[[slots.get(r, _ZERO_SLOT) for r in req_ids]].tolist()
        incomplete = self._incomplete
        ok = predictor is not None
        return [[*header, int(ok and r not in incomplete), *row]
                for r, row in zip(req_ids, rows, strict=True)]

    def record(self, req_id: str) -> WireRecord:
        return WireRecord.decode(self.encode_records([req_id])[0])

    def mark_incomplete(self, req_ids: Iterable[str]) -> None:
        """A step of these requests could not be accounted: their energy will be omitted."""
        self._incomplete.update(req_ids)

    def release(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._rows[slot] = 0.0
            self._free.append(slot)
        self._incomplete.discard(req_id)

    def sweep(self, live: Iterable[str]) -> None:
        """Release requests the engine no longer has (aborted without a final output)."""
        live_set = set(live)
        for req_id in [r for r in self._slots if r not in live_set]:
            self.release(req_id)

    @property
    def tracked_requests(self) -> int:
        return len(self._slots)

    def _slot(self, req_id: str) -> int:
        slot = self._slots.get(req_id)
        if slot is None:
            if not self._free:
                old = self._rows.shape[0]
                self._rows = np.vstack([self._rows, np.zeros((max(16, old), _ROW))])
                self._free.extend(range(self._rows.shape[0] - 1, old - 1, -1))
            slot = self._free.pop()
            self._slots[req_id] = slot
        return slot
