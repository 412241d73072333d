"""Engine-side energy accounting: predict each step, split it among the step's requests, keep
each request's running total, and encode it for the trip to the API server. No vLLM imports:
`hooks/engine.py` feeds it plain numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

from vllm_piep.flops import StepBatch
from vllm_piep.once import OnceLogger, logger
from vllm_piep.predict.attribution import prefill_fraction, split_step
from vllm_piep.predict.base import Predictor, StepInput
from vllm_piep.wire import (
    DECODE,
    FIRST_COMPONENT,
    INCOMPLETE,
    PREFILL,
    ROW,
    ROW_BYTES,
    StepHeader,
    WireRecord,
)

_MAX_PENDING_STEPS = 64  # scheduled but not yet updated steps (async scheduling, PP batch queue)
_ZERO_SLOT = 0  # row 0 stays zero: requests the engine has no step for yet


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
        self._rows = np.zeros((1, ROW))
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
            self.mark_incomplete(req_ids)
            return
        increment = np.empty((len(req_ids), ROW))
        increment[:, FIRST_COMPONENT:] = per_request
        increment[:, INCOMPLETE] = 0.0
        total = per_request.sum(axis=1)
        if batch.array[:, 0].any():  # some prompt tokens in this step
            np.multiply(total, prefill_fraction(batch), out=increment[:, PREFILL])
            np.subtract(total, increment[:, PREFILL], out=increment[:, DECODE])
        else:  # a pure decode step, the common case
            increment[:, PREFILL] = 0.0
            increment[:, DECODE] = total
        get = self._slots.get
        slots = [get(r) for r in req_ids]
        if None in slots:  # new requests: may grow the array, so index it afterwards
            slots = [s if s is not None else self._slot(r) for s, r in zip(slots, req_ids)]
        self._rows[slots] += increment  # a request appears once per step: no index repeats
        self.total_joules += float(step.joules.sum())

    # -- per request -------------------------------------------------------------------------
    def header(self) -> StepHeader:
        predictor = self._predictor
        if predictor is None:
            return StepHeader("none", "none", self.engine_id, self.total_joules, self.errors,
                              False)
        return StepHeader(predictor.source, predictor.bundle_id, self.engine_id,
                          self.total_joules, self.errors, True)

    def encode_rows(self, req_ids: list[str]) -> list[bytes]:
        """Each request's running total as bytes (`vllm_piep.wire`): one copy, then slices."""
        slots = self._slots
        data = self._rows[[slots.get(r, _ZERO_SLOT) for r in req_ids]].tobytes()
        return [data[i:i + ROW_BYTES] for i in range(0, len(data), ROW_BYTES)]

    def record(self, req_id: str) -> WireRecord:
        return WireRecord.from_wire(self.header(), self.encode_rows([req_id])[0])

    def mark_incomplete(self, req_ids: Iterable[str]) -> None:
        """A step of these requests could not be accounted: their energy will be omitted."""
        for req_id in req_ids:
            slot = self._slot(req_id)  # may grow (replace) the array: index it afterwards
            self._rows[slot, INCOMPLETE] = 1.0

    def release(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._rows[slot] = 0.0
            self._free.append(slot)

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
                self._rows = np.vstack([self._rows, np.zeros((max(16, old), ROW))])
                self._free.extend(range(self._rows.shape[0] - 1, old - 1, -1))
            slot = self._free.pop()
            self._slots[req_id] = slot
        return slot
