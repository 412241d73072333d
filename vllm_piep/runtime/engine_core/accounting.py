"""Engine-side energy accounting: predict each step, split it among the step's requests, keep
each request's running total, and encode them for the trip to the API server. No vLLM imports:
`scheduler.py` feeds it plain numbers, as the scheduler holds them.

Per step the work is a handful of whole-array calls and, for the prior and calibrated
bundles, one onnxruntime call (`predict.stepgraph`) that computes the features, predicts the
step and splits it. Other predictors (`PIEP_PREDICTOR`) get a `StepBatch` and are split here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from vllm_piep.model.flops import StepBatch
from vllm_piep.once import OnceLogger, logger
from vllm_piep.predict.attribution import prefill_fraction, split_step
from vllm_piep.predict.base import Predictor, StepInput
from vllm_piep.predict.stepgraph import N_OUT, raw_inputs
from vllm_piep.runtime.record import COLUMN, ROW_FIELDS, StepHeader, WireRecord, encode_rows
from vllm_piep.runtime.worker.steptime import ENGINE_CLOCK, STEP_TIMERS

_MAX_PENDING_STEPS = 64  # scheduled but not yet updated steps (async scheduling, PP batch queue)
_PREFILL, _DECODE, _INCOMPLETE = COLUMN["prefill"], COLUMN["decode"], COLUMN["incomplete"]
# The rows carry the record's fields, then one column of the accountant's own: the request's
# total when an output last carried it.
_SENT = len(ROW_FIELDS)
_COLS = _SENT + 1
_ZERO_SLOT = 0  # row 0 stays zero: requests the engine has no step for yet


class Gone(NamedTuple):
    """A request the engine released while a step already scheduled may still name it."""

    step: int  # the engine's step count at the release
    aborted: bool  # False: it finished and its final output went out
    prompt: float  # its prompt length, for the share of a step that still names it


class ScheduledStep(NamedTuple):
    """One scheduled step, as the scheduler holds it (see `predict.stepgraph`)."""

    req_ids: list[str]
    sched: np.ndarray  # [4, N]: computed before the step, scheduled, outputs so far, draws
    new_prompts: dict[str, int]  # prompt lengths of requests the accountant has not seen
    prompt: np.ndarray | None = None  # [1, N] given outright (a `StepBatch`), not stored

    @classmethod
    def of_batch(cls, req_ids: list[str], batch: StepBatch) -> ScheduledStep:
        """The scheduler numbers that give exactly this batch's work."""
        sched, prompt = raw_inputs(batch)
        return cls(list(req_ids), sched, {}, prompt)


def step_batch(sched: np.ndarray, prompt: np.ndarray) -> StepBatch:
    """The `StepBatch` of raw scheduler numbers (for predictors without a step graph)."""
    start, n, outs, draws = sched
    end = start + n
    pre = np.maximum(np.minimum(end, prompt) - start, 0.0)
    rows = (end >= prompt + outs) * draws
    return StepBatch(np.column_stack([pre, n - pre, start, rows]))


class EngineAccountant:
    """Per engine core: step predictions, per-request running totals, engine totals."""

    def __init__(self, make_predictor: Callable[[], Predictor], engine_id: str = "0",
                 clock_ns: Callable[[], int] = time.perf_counter_ns) -> None:
        self._make_predictor = make_predictor
        self._predictor: Predictor | None = None
        self._predictor_failed = False
        self._run_step: Callable | None = None
        self.engine_id = engine_id
        self._clock_ns = clock_ns
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._rows = np.zeros((1, _COLS))
        self._prompt = np.zeros(1)
        self._pending: dict[int, tuple[ScheduledStep, int]] = {}
        # Released requests: vLLM aborts requests between a step's scheduling and its update,
        # and with async scheduling a request that finishes is already in the next step.
        self._gone: dict[str, Gone] = {}
        self._held: list[str] | None = None  # aborts deferred until this step's outputs went
        self._last_sweep = 0
        self._last_done_ns: int | None = None
        self.total_joules = 0.0
        self.unsent_joules = 0.0
        self.after_finish_joules = 0.0
        self.errors = 0
        self.steps = 0
        self.steps_by_timer = dict.fromkeys(STEP_TIMERS, 0)
        self._once = OnceLogger()

    # -- predictor ---------------------------------------------------------------------------
    @property
    def predictor(self) -> Predictor | None:
        if self._predictor is None and not self._predictor_failed:
            try:
                self._predictor = self._make_predictor()
                self._run_step = getattr(self._predictor, "run_step", None)
            except Exception as exc:  # boundary: a bad predictor must not stop serving
                self._predictor_failed = True
                self.errors += 1
                self._once.warn("loading the energy predictor", exc,
                                "responses will carry no usage.energy")
        return self._predictor

    # -- per step ----------------------------------------------------------------------------
    def on_schedule(self, key: int, step: ScheduledStep | list[str],
                    batch: StepBatch | None = None) -> None:
        """A step was scheduled; its work is known now, its duration when it is done. Either
        a `ScheduledStep`, or request ids and their `StepBatch`."""
        if not isinstance(step, ScheduledStep):
            assert batch is not None, "request ids need their StepBatch"
            step = ScheduledStep.of_batch(step, batch)
        if len(self._pending) >= _MAX_PENDING_STEPS:  # never grows without bound
            self._pending.pop(next(iter(self._pending)))
        self._pending[key] = (step, self._clock_ns())

    def on_step_done(self, key: int, worker_step_ns: int | None = None,
                     timer: str | None = None) -> None:
        """The step's model output arrived: predict it and add each request's share.

        The step time is the worker's (where the model ran; `timer` names its clock) when it
        sent one; else the engine's wall time since the step could start: after it was
        scheduled and after the previous step finished (with async scheduling they overlap;
        this keeps the steps disjoint). The fallback is counted (`steps_by_timer`) and said
        once in the log.
        """
        pending = self._pending.pop(key, None)
        now = self._clock_ns()
        if pending is None:
            return
        step, scheduled_ns = pending
        start = scheduled_ns if self._last_done_ns is None else max(scheduled_ns,
                                                                    self._last_done_ns)
        self._last_done_ns = now
        if worker_step_ns is None:
            step_ns, timer = now - start, ENGINE_CLOCK
            if self.steps_by_timer[ENGINE_CLOCK] == 0:
                logger.warning(
                    "vllm_piep: a step came back without the worker's step time (the worker "
                    "patches are not installed in the process that runs the model, or an "
                    "executor dropped the output's attributes); its energy uses the engine's "
                    "wall clock between steps, counted in "
                    "piep_engine_steps_total{step_time=\"engine_clock\"}")
        else:
            step_ns = worker_step_ns
            if timer not in self.steps_by_timer:
                timer = STEP_TIMERS[1]
            if self.steps == 0:
                logger.info("vllm_piep: step times from the worker's %s", timer)
        self.steps_by_timer[timer] += 1
        self.steps += 1
        slots = self._slots_of(step)
        predictor = self.predictor
        try:
            if predictor is None:
                raise RuntimeError("no predictor")
            prompt = self._prompt[slots][None, :] if step.prompt is None else step.prompt
            if self._run_step is not None:
                requests, joules = self._run_step(step.sched, prompt, step_ns / 1e9)
                increment = requests.T
            else:
                increment, joules = self._split_elsewhere(predictor, step, prompt, step_ns)
            total = float(joules.sum())  # non-negative parts: finite iff every part is
            if not math.isfinite(total):
                raise ValueError(f"non-finite step energy {joules}")
        except Exception as exc:  # boundary
            if predictor is not None:
                self.errors += 1
                self._once.warn("predicting a step's energy", exc,
                                "the requests in that step get no usage.energy")
            self._rows[slots, _INCOMPLETE] = 1.0
            if self._gone:
                self._forget_gone(step.req_ids)
            return
        self._rows[slots, :N_OUT] += increment  # a request appears once per step
        self.total_joules += total
        if self._gone:
            self._forget_gone(step.req_ids)

    def _forget_gone(self, req_ids: list[str]) -> None:
        """Requests released while a step of theirs ran: no output will carry this step's
        share. An aborted request's share is unsent energy; a finished one's (async
        scheduling had already put it into this step) is after-finish energy. Neither may stay
        tracked."""
        for req_id in self._gone.keys() & set(req_ids):
            self.release(req_id, aborted=self._gone[req_id].aborted, final=True)
        oldest = self.steps - _MAX_PENDING_STEPS
        for req_id in [r for r, gone in self._gone.items() if gone.step < oldest]:
            del self._gone[req_id]

    @staticmethod
    def _split_elsewhere(predictor: Predictor, step: ScheduledStep, prompt: np.ndarray,
                         step_ns: int) -> tuple[np.ndarray, np.ndarray]:
        """A predictor without a step graph: its `predict_step`, split here."""
        batch = step_batch(step.sched, prompt[0])
        energy = predictor.predict_step(StepInput(batch=batch, step_seconds=step_ns / 1e9))
        per_request = split_step(energy)
        increment = np.empty((len(batch), N_OUT))
        increment[:, 2:] = per_request
        total = per_request.sum(axis=1)
        increment[:, _PREFILL] = total * prefill_fraction(batch)
        increment[:, _DECODE] = total - increment[:, _PREFILL]
        return increment, np.asarray(energy.joules, dtype=np.float64)

    def _slots_of(self, step: ScheduledStep) -> np.ndarray:
        """The requests' rows, as an index array (numpy converts a list on every use)."""
        ids = step.req_ids
        try:
            slots = np.fromiter(map(self._slots.__getitem__, ids), np.intp, len(ids))
        except KeyError:  # new requests: may grow the arrays, so index them afterwards
            slots = np.fromiter(map(self._slot, ids), np.intp, len(ids))
        for req_id, n in step.new_prompts.items():
            self._prompt[self._slots[req_id]] = n
        return slots

    # -- per request -------------------------------------------------------------------------
    def header(self, totals: bool = True) -> StepHeader:
        """Who predicted; with `totals`, the engine's totals (else zeros, never counted)."""
        predictor = self._predictor
        if totals:
            joules, errors, unsent, tracked = (self.total_joules, self.errors,
                                               self.unsent_joules, len(self._slots))
            after, timers = self.after_finish_joules, tuple(self.steps_by_timer.values())
        else:
            joules, errors, unsent, tracked, after, timers = 0.0, 0, 0.0, 0, 0.0, (0,) * 3
        if predictor is None:
            return StepHeader(source="none", bundle_id="none", engine_id=self.engine_id,
                              engine_joules=joules, engine_errors=errors, predictor_ok=False,
                              unsent_joules=unsent, tracked=tracked,
                              after_finish_joules=after, steps_by_timer=timers)
        interval = getattr(predictor, "interval", None)
        return StepHeader(
            source=predictor.source, bundle_id=predictor.bundle_id, engine_id=self.engine_id,
            engine_joules=joules, engine_errors=errors, predictor_ok=True,
            unsent_joules=unsent, tracked=tracked,
            interval=None if interval is None else (interval.lower, interval.upper),
            interval_level=None if interval is None else interval.level,
            interval_coverage=None if interval is None else interval.coverage,
            after_finish_joules=after, steps_by_timer=timers)

    def encode(self, req_ids: list[str]) -> bytes:
        """These requests' running totals as one block (`vllm_piep.runtime.record`), and
        remember that an output carried them."""
        get = self._slots.get
        slots = np.fromiter((get(r, _ZERO_SLOT) for r in req_ids), np.intp, len(req_ids))
        block = self._rows[slots]
        self._rows[slots, _SENT] = block[:, _PREFILL] + block[:, _DECODE]
        self._rows[_ZERO_SLOT] = 0.0
        return encode_rows(block)

    def record(self, req_id: str) -> WireRecord:
        """A request's running total, decoded (for tests and tools; nothing is marked sent)."""
        slot = self._slots.get(req_id, _ZERO_SLOT)
        return WireRecord.from_wire(self.header(), encode_rows(self._rows[slot:slot + 1]))

    def mark_incomplete(self, req_ids: Iterable[str]) -> None:
        """A step of these requests could not be accounted: their energy will be omitted."""
        for req_id in req_ids:
            slot = self._slot(req_id)  # may grow (replace) the array: index it afterwards
            self._rows[slot, _INCOMPLETE] = 1.0

    def release(self, req_id: str, aborted: bool = True, final: bool = False) -> None:
        """The engine is done with the request (`aborted`: from outside, with no final
        output, possibly while a step of it runs; else it finished with this output). Energy
        no output carried is counted as unsent (aborted) or after-finish (finished), so the
        engine's totals still add up. `final`: a gone request's late step was accounted."""
        if aborted and self._held is not None and not final:  # its output still goes out
            self._held.append(req_id)
            return
        slot = self._slots.pop(req_id, None)
        prompt = 0.0
        if slot is not None:
            row = self._rows[slot]
            left = max(0.0, float(row[_PREFILL] + row[_DECODE] - row[_SENT]))
            if aborted:
                self.unsent_joules += left
            else:
                self.after_finish_joules += left
            row[:] = 0.0
            prompt = float(self._prompt[slot])
            self._prompt[slot] = 0.0
            self._free.append(slot)
        if aborted or self._pending:  # a step already scheduled may still name it
            gone = self._gone.get(req_id)
            self._gone[req_id] = Gone(self.steps, aborted,
                                      prompt if gone is None or prompt else gone.prompt)

    def hold_releases(self) -> None:
        """vLLM may finish requests inside `update_from_output` (errors): their outputs of
        this step still carry their totals, so their release waits for `release_held`."""
        self._held = []

    def release_held(self) -> None:
        held, self._held = self._held, None
        for req_id in held or ():
            self.release(req_id)

    def sweep(self, live: Iterable[str], every: int = 1) -> None:
        """Release requests the engine no longer has (aborted without a final output); at most
        once per `every` steps."""
        if self.steps - self._last_sweep < every:
            return
        self._last_sweep = self.steps
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
                grow = max(16, old)
                self._rows = np.vstack([self._rows, np.zeros((grow, _COLS))])
                self._prompt = np.concatenate([self._prompt, np.zeros(grow)])
                self._free.extend(range(self._rows.shape[0] - 1, old - 1, -1))
            slot = self._free.pop()
            self._slots[req_id] = slot
            gone = self._gone.get(req_id) if self._gone else None
            if gone is not None:  # a late step of a released request: its prompt still counts
                self._prompt[slot] = gone.prompt
        return slot
