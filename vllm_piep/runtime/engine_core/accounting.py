"""Engine-side energy accounting: predict each step, split it among the step's requests, keep
each request's running total, and encode them for the trip to the API server. No vLLM imports:
`scheduler.py` feeds it plain numbers, as the scheduler holds them.

Per step the work is a handful of whole-array calls and, for the prior and calibrated
bundles, one onnxruntime call (`predict.stepgraph`) that computes the features, predicts the
step and splits it. Other predictors (`PIEP_PREDICTOR`) get a `StepBatch` and are split here.
The engine loop does none of it: it queues the calls (`deferred`) with the times it saw, and
they run off the loop, in order (`deferred.py`).

In prediction mode a served engine is `sparse`: a request's running total is read only where an
output carries it (an output that finishes the request, or every output of a request the API
server may finish itself: one with stop strings), so the steps done since the last such read are
evaluated then, predicted in one call (`evaluate`, `StepGraph.run_many`), instead of one at a
time after each device wait; whatever reads the state (a release, the counts, a row) evaluates
them first, so the state is the one evaluating each step at once gives (to rounding).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from vllm_piep.meters.split import IntervalSplitter, PendingStep, Settled
from vllm_piep.model.flops import StepBatch
from vllm_piep.once import OnceLogger, logger
from vllm_piep.predict.attribution import prefill_fraction, split_step
from vllm_piep.predict.base import Predictor, StepInput
from vllm_piep.predict.stepgraph import N_OUT, raw_inputs
from vllm_piep.runtime.engine_core.deferred import DeferredCalls
from vllm_piep.runtime.engine_core.warmup import WarmupDetector
from vllm_piep.runtime.record import COLUMN, ROW_FIELDS, StepHeader, WireRecord, encode_rows
from vllm_piep.runtime.worker.steptime import ENGINE_CLOCK, STEP_TIMERS

_MAX_PENDING_STEPS = 64  # scheduled but not yet updated steps (async scheduling, PP batch queue)
_PREFILL, _DECODE, _INCOMPLETE = COLUMN["prefill"], COLUMN["decode"], COLUMN["incomplete"]
_STATIC = COLUMN["static"]
_PREDICTED, _UNMEASURED = COLUMN["predicted"], COLUMN["unmeasured"]
_MAX_RELEASED = 4096  # released requests remembered for their steps still to be settled
# Sparse mode: done steps waiting for evaluation, at most. A finishing output's batch waits
# for their evaluation: this bounds how long (measured in docs/benchmarks.md).
MAX_UNEVALUATED = 16
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


class Suspect(NamedTuple):
    """A step run before the warm-up rule could judge it (`warmup.py`)."""

    tokens: float
    seconds: float
    req_ids: list[str]
    increment: np.ndarray  # its [N, N_OUT] shares, as added to the requests' rows


class Counts(NamedTuple):
    """What the engine counted, cumulative since it started (the record's header fields)."""

    step_joules: float = 0.0
    errors: int = 0
    unsent_joules: float = 0.0
    aborted_joules: float = 0.0
    after_finish_joules: float = 0.0
    warmup_joules: float = 0.0
    predicted_joules: float = 0.0
    idle_joules: float = 0.0
    fitted_joules: float = 0.0
    fallback_steps: int = 0
    steps_by_timer: tuple[int, ...] = (0,) * len(STEP_TIMERS)  # last: not a number


class StepPayload(NamedTuple):
    """A measured-mode step waiting for the meter: what its settlement scales."""

    seq: int
    slots: np.ndarray
    req_ids: list[str]
    increment: np.ndarray  # [N, N_OUT] predicted shares
    warmup_j: float  # predicted warm-up energy taken out of the shares


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
        self._run_many: Callable | None = None  # several steps in one call (sparse mode)
        self.engine_id = engine_id
        # The accountant's clock (the loop reads it when it queues a step's calls): a plain
        # attribute, one lookup fewer than a method on the loop's critical path.
        self.now_ns = clock_ns
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
        self.aborted_joules = 0.0
        self.warmup_joules = 0.0
        self.errors = 0
        self.steps = 0
        self.steps_by_timer = dict.fromkeys(STEP_TIMERS, 0)
        self.warmup = WarmupDetector()
        self._suspects: list[Suspect] = []
        self._warmup_said = False
        # What went out to the API servers: each increment is sent once (`header`). The lock
        # lets the engine's idle flush and its step loop take them without sending one twice.
        self._reported = Counts()
        self._counts_lock = threading.Lock()
        self.counts_client = 0  # the API server client the counts last went to
        self._once = OnceLogger()
        # Measured mode (`measured.py`): steps wait in the splitter until the meter speaks for
        # them; the lock serialises the engine loop and the meter thread.
        self.lock = threading.RLock()
        self.splitter: IntervalSplitter | None = None
        self.meter_name: str | None = None
        self.meter_source = "measured"
        self.predicted_joules = self.idle_joules = self.fitted_joules = 0.0
        self.fallback_steps = 0
        self.settled_seq = 0  # steps settle in order: every step up to this one is settled
        self._last_seq = np.zeros(1, dtype=np.int64)  # per slot: the last step naming it
        self._released: OrderedDict[str, bool] = OrderedDict()  # req id -> aborted
        self.holding: set[str] = set()  # finished requests whose output waits for the meter
        self.meter_note: str | None = None  # why not measured mode, where a meter was to serve
        self.meter_shared = 0  # others' processes on the metered GPUs (-1: cannot tell)
        self.engine_meter: Any = None  # measured.EngineMeter, once started
        self.meter_tried = False
        # The engine loop's calls, run off the loop in order (`deferred.py`); run them with
        # `lock` held before reading the state they change.
        self.deferred = DeferredCalls(self._deferred_failed)
        self.loop_steps = 0  # steps updated (every `_SWEEP_EVERY`, a sweep is due: `LoopHandle`)
        # Requests vLLM finished inside the update being accounted (errors), until its call.
        self.errored_in_update: list[str] = []
        # Sparse mode (module docstring): set by the served engine; prediction mode only.
        self.sparse = False
        self.dense_ids: set[str] = set()  # requests whose every output carries its row
        self._done: list[tuple[tuple[ScheduledStep | Callable[[], ScheduledStep], int],
                               int | None, str | None, int]] = []
        self._counts_changed = False  # since the counts last went out (sparse mode)

    def _deferred_failed(self, call: str, exc: BaseException) -> None:
        self.errors += 1
        self._once.warn(f"accounting a step ({call})", exc,
                        "energy of the affected requests may be missing")

    # -- predictor ---------------------------------------------------------------------------
    @property
    def predictor(self) -> Predictor | None:
        if self._predictor is None and not self._predictor_failed:
            try:
                self._predictor = self._make_predictor()
                self._run_step = getattr(self._predictor, "run_step", None)
                self._run_many = getattr(getattr(self._predictor, "graph", None), "run_many",
                                         None)
            except Exception as exc:  # boundary: a bad predictor must not stop serving
                self._predictor_failed = True
                self.errors += 1
                self._once.warn("loading the energy predictor", exc,
                                "responses will carry no usage.energy")
        return self._predictor

    # -- per step ----------------------------------------------------------------------------
    def on_schedule(self, key: int,
                    step: ScheduledStep | Callable[[], ScheduledStep] | list[str],
                    batch: StepBatch | None = None, at_ns: int | None = None) -> None:
        """A step was scheduled (at `at_ns`, else now); its work is known now, its duration
        when it is done. A `ScheduledStep` (or what makes it, called when the step is
        evaluated), or request ids and their `StepBatch`."""
        if isinstance(step, list):
            assert batch is not None, "request ids need their StepBatch"
            step = ScheduledStep.of_batch(step, batch)
        if len(self._pending) >= _MAX_PENDING_STEPS:  # never grows without bound
            self._pending.pop(next(iter(self._pending)))
        self._pending[key] = (step, self.now_ns() if at_ns is None else at_ns)

    def on_step_done(self, key: int, worker_step_ns: int | None = None,
                     timer: str | None = None, at_ns: int | None = None) -> None:
        """The step's model output arrived (at `at_ns`, else now): predict it and add each
        request's share.

        The step time is the worker's (where the model ran; `timer` names its clock) when it
        sent one; else the engine's wall time since the step could start: after it was
        scheduled and after the previous step finished (with async scheduling they overlap;
        this keeps the steps disjoint). The fallback is counted (`steps_by_timer`) and said
        once in the log.
        """
        pending = self._pending.pop(key, None)
        now = self.now_ns() if at_ns is None else at_ns
        if pending is None:
            return
        if self.sparse and self.splitter is None:
            # Keys are ids of vLLM's scheduler outputs, reused once freed: the step leaves
            # `_pending` now, its evaluation waits until something reads the state.
            self._done.append((pending, worker_step_ns, timer, now))
            if len(self._done) >= MAX_UNEVALUATED:
                self.evaluate()
            return
        self._evaluate_step(pending, worker_step_ns, timer, now)

    def evaluate(self) -> None:
        """Sparse mode: evaluate the done steps not evaluated yet, oldest first (anything that
        reads the state calls it first). Steps go to the predictor together, in one call
        (`StepGraph.run_many`), except where a step's result depends on the one before: a
        step naming a released request (the release frees rows a later step may take) and
        the steps before the warm-up rule is ready (judging them edits earlier rows)."""
        if not self._done:
            return
        # Taken whole: a release inside a step's evaluation (a gone request's late step)
        # evaluates nothing further, as it would have evaluated nothing at once either.
        done, self._done = self._done, []
        self._counts_changed = True
        run_many = self._run_many if self.predictor is not None else None
        together: list[tuple[ScheduledStep, np.ndarray, int, int]] = []
        for (made, scheduled_ns), worker_step_ns, timer, now in done:
            try:
                step = made if isinstance(made, ScheduledStep) else made()
                if run_many is None or not self.warmup.ready or (
                        self._gone and not self._gone.keys().isdisjoint(step.req_ids)):
                    self._evaluate_together(together)
                    together = []
                    self._evaluate_step((step, scheduled_ns), worker_step_ns, timer, now)
                    continue
                step_ns = self._step_ns(scheduled_ns, worker_step_ns, timer, now)
                together.append((step, self._slots_of(step), step_ns, now))
            except Exception as exc:  # boundary: one bad step must not lose the others
                self._deferred_failed("evaluating a step", exc)
        self._evaluate_together(together)

    def _evaluate_together(self, steps: list[tuple[ScheduledStep, np.ndarray, int, int]]
                           ) -> None:
        """Steps whose times and rows are known, predicted in one call, then added in order;
        if that call fails, each step alone (only a bad step loses its energy). One step goes
        to the step graph, as a dense engine's would."""
        requests = joules = None
        if len(steps) > 1:
            assert self._run_many is not None
            try:
                sizes = [len(slots) for _, slots, _, _ in steps]
                requests, joules = self._run_many(
                    np.concatenate([step.sched for step, _, _, _ in steps], axis=1),
                    np.concatenate([self._prompt[slots] if step.prompt is None
                                    else step.prompt[0] for step, slots, _, _ in steps]),
                    np.array([step_ns / 1e9 for _, _, step_ns, _ in steps]),
                    np.cumsum([0, *sizes[:-1]]))
            except Exception:  # boundary
                requests = joules = None
        end = 0
        for k, (step, slots, step_ns, now) in enumerate(steps):
            try:
                if requests is None or joules is None:
                    self._predict_step(step, slots, step_ns, now)
                    continue
                start, end = end, end + sizes[k]
                self._add_predicted(step, slots, requests.T[start:end], joules[:, k], step_ns,
                                    now)
            except Exception as exc:  # boundary: one bad step must not lose the others
                self._deferred_failed("evaluating a step", exc)

    def _evaluate_step(self, pending: tuple[ScheduledStep | Callable[[], ScheduledStep], int],
                       worker_step_ns: int | None, timer: str | None, now: int) -> None:
        made, scheduled_ns = pending
        step = made if isinstance(made, ScheduledStep) else made()
        step_ns = self._step_ns(scheduled_ns, worker_step_ns, timer, now)
        self._predict_step(step, self._slots_of(step), step_ns, now)

    def _predict_step(self, step: ScheduledStep, slots: np.ndarray, step_ns: int, now: int
                      ) -> None:
        """One step alone: predicted, split, added."""
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
        except Exception as exc:  # boundary
            self._step_failed(exc, step, slots)
            return
        self._add_predicted(step, slots, increment, joules, step_ns, now)

    def _add_predicted(self, step: ScheduledStep, slots: np.ndarray, increment: np.ndarray,
                       joules: np.ndarray, step_ns: int, now: int) -> None:
        """A predicted step's shares added, unless its energy is not finite (then it failed)."""
        total = float(joules.sum())  # non-negative parts: finite iff every part is
        if not math.isfinite(total):
            self._step_failed(ValueError(f"non-finite step energy {joules}"), step, slots)
            return
        self._add_step(step, slots, increment, total, step_ns, now)

    def _step_ns(self, scheduled_ns: int, worker_step_ns: int | None, timer: str | None,
                 now: int) -> int:
        """The step's time (`on_step_done`), counted by the clock that gave it."""
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
        return step_ns

    def _step_failed(self, exc: BaseException, step: ScheduledStep, slots: np.ndarray) -> None:
        """A step that could not be predicted: its requests' energy is incomplete (no
        predictor: said once when loading it)."""
        if self._predictor is not None:
            self.errors += 1
            self._once.warn("predicting a step's energy", exc,
                            "the requests in that step get no usage.energy")
        self._rows[slots, _INCOMPLETE] = 1.0
        if self._gone:
            self._forget_gone(step.req_ids)

    def _add_step(self, step: ScheduledStep, slots: np.ndarray, increment: np.ndarray,
                  total: float, step_ns: int, now: int) -> None:
        """A predicted step's shares into its requests' rows (measured mode: to the meter)."""
        increment, warmup_j = self._take_warmup(step, increment, step_ns / 1e9)
        if self.splitter is not None:
            self._defer(step, slots, increment, warmup_j, total, now - step_ns, now)
            return
        self._rows[slots, :N_OUT] += increment  # a request appears once per step
        self.total_joules += total
        self.warmup_joules += warmup_j
        if self._gone:
            self._forget_gone(step.req_ids)

    # -- warm-up (`warmup.py`) ---------------------------------------------------------------
    def _take_warmup(self, step: ScheduledStep, increment: np.ndarray, seconds: float
                     ) -> tuple[np.ndarray, float]:
        """The step's shares without its warm-up energy, and that energy (counted apart).
        In measured mode the first steps are not judged afterwards (their energy may be
        settled and sent by then): only steps after the detector is ready."""
        tokens = float(step.sched[1].sum())
        detector = self.warmup
        if not detector.ready:
            detector.observe(tokens, seconds)
            if self.splitter is None:
                self._suspects.append(Suspect(tokens, seconds, list(step.req_ids),
                                              increment.copy()))
                if detector.ready:
                    self._judge_suspects()
            return increment, 0.0
        excess = detector.excess_s(tokens, seconds)
        detector.observe(tokens, seconds - excess)
        if excess <= 0.0:
            return increment, 0.0
        moved = _warmup_part(increment, excess / seconds)
        self._say_warmup(excess, seconds)
        return increment - moved, float(moved[:, _STATIC].sum())

    def _judge_suspects(self) -> None:
        """The first steps, judged once the history allows: their warm-up energy leaves the
        rows of their requests that are still in flight."""
        suspects, self._suspects = self._suspects, []
        for suspect in suspects:
            excess = self.warmup.excess_s(suspect.tokens, suspect.seconds)
            if excess <= 0.0:
                continue
            moved = _warmup_part(suspect.increment, excess / suspect.seconds)
            for req_id, part in zip(suspect.req_ids, moved, strict=True):
                slot = self._slots.get(req_id)
                if slot is not None and req_id not in self._gone:
                    self._rows[slot, :N_OUT] -= part
                    self.warmup_joules += float(part[_STATIC])
            self._say_warmup(excess, suspect.seconds)

    def _say_warmup(self, excess: float, seconds: float) -> None:
        if not self._warmup_said:
            self._warmup_said = True
            logger.info("vllm_piep: a %.2f s step held %.2f s of one-off work (warm-up); its "
                        "static energy is counted under outcome `warmup`, not billed to the "
                        "step's requests", seconds, excess)

    # -- measured mode (`measured.py`) -------------------------------------------------------
    def measure_with(self, splitter: IntervalSplitter, meter_name: str, source: str) -> None:
        """From now on each step waits for the meter (`settle`)."""
        with self.lock:
            self.evaluate()  # steps done before: predicted, as every step until now
            self.splitter, self.meter_name, self.meter_source = splitter, meter_name, source

    def _defer(self, step: ScheduledStep, slots: np.ndarray, increment: np.ndarray,
               warmup_j: float, total: float, t0_ns: int, t1_ns: int) -> None:
        assert self.splitter is not None
        self._rows[slots, _PREDICTED] += increment[:, _PREFILL] + increment[:, _DECODE]
        self._last_seq[slots] = self.steps
        static = float(increment[:, _STATIC].sum()) + warmup_j
        self.splitter.add_step(PendingStep(
            t0_ns, t1_ns, static, max(0.0, total - static),
            StepPayload(self.steps, slots, list(step.req_ids), increment, warmup_j)))
        if self._gone:
            self._forget_gone(step.req_ids)

    def steps_in_flight(self) -> int:
        """Steps scheduled whose output has not come back."""
        return len(self._pending)

    def known_until_ns(self) -> int:
        """Up to when every step's time is known: now when no step is in flight, else the
        end of the last step done (a step in flight started after it)."""
        if not self._pending:
            return self.now_ns()
        return self._last_done_ns or 0

    def settle(self, fallback_until_ns: int | None = None) -> int:
        """Settle the steps the meter's readings cover (or, with `fallback_until_ns`, the
        steps ended by then, by the fit): their measured energy goes into the rows of their
        requests. Returns how many steps were settled. Call with `lock` held."""
        splitter = self.splitter
        if splitter is None:
            return 0
        if fallback_until_ns is None:
            done = splitter.settle(self.known_until_ns())
        else:
            done = splitter.fallback(fallback_until_ns)
        self._apply_settled(done)
        return len(done.steps)

    def _apply_settled(self, done: Settled) -> None:
        self.idle_joules += done.idle_j
        live = self._slots
        for step in done.steps:
            payload: StepPayload = step.payload
            ratio = step.ratio
            self.total_joules += step.measured_j
            self.predicted_joules += step.predicted_j
            self.warmup_joules += ratio * payload.warmup_j
            if step.fallback:
                self.fitted_joules += step.fitted_j
                self.fallback_steps += 1
            scaled = payload.increment * ratio
            slots = payload.slots
            mine = np.fromiter((live.get(r) == s for r, s in zip(payload.req_ids,
                                                                 slots.tolist(),
                                                                 strict=True)),
                               bool, len(payload.req_ids))
            self._rows[slots[mine], :N_OUT] += scaled[mine]
            if step.fallback:
                increment = payload.increment[mine]
                self._rows[slots[mine], _UNMEASURED] += (increment[:, _PREFILL]
                                                         + increment[:, _DECODE])
            for i in np.flatnonzero(~mine):  # released since: no output will carry it
                joules = float(scaled[i, _PREFILL] + scaled[i, _DECODE])
                if self._released.get(payload.req_ids[i], True):
                    self.unsent_joules += joules
                else:
                    self.after_finish_joules += joules
            self.settled_seq = payload.seq

    def unsettled(self, req_id: str) -> bool:
        """Whether a step of this request still waits for the meter."""
        slot = self._slots.get(req_id)
        return slot is not None and int(self._last_seq[slot]) > self.settled_seq

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
    def counts(self) -> Counts:
        self.evaluate()
        return Counts(self.total_joules, self.errors, self.unsent_joules, self.aborted_joules,
                      self.after_finish_joules, self.warmup_joules, self.predicted_joules,
                      self.idle_joules, self.fitted_joules, self.fallback_steps,
                      tuple(self.steps_by_timer.values()))

    def unreported(self) -> bool:
        """Whether some count has not gone out yet (the idle flush asks)."""
        return self.counts() != self._reported

    def header(self, counts: bool = True) -> StepHeader:
        """Who predicted; with `counts`, the engine's counts since they last went out (each
        increment goes out once: the caller sends this header to one API server), else
        zeros."""
        predictor = self._predictor
        if counts:
            with self._counts_lock:
                now, before = self.counts(), self._reported
                self._reported = now
                self._counts_changed = False
            delta = Counts(*(a - b for a, b in zip(now[:-1], before[:-1], strict=True)),
                           tuple(a - b for a, b in zip(now.steps_by_timer, before.steps_by_timer,
                                                       strict=True)))
            tracked = len(self._slots)
        else:
            delta, tracked = Counts(), 0
        common = dict(engine_id=self.engine_id, step_joules=delta.step_joules,
                      errors=delta.errors, unsent_joules=delta.unsent_joules, tracked=tracked,
                      aborted_joules=delta.aborted_joules,
                      after_finish_joules=delta.after_finish_joules,
                      steps_by_timer=delta.steps_by_timer, warmup_joules=delta.warmup_joules,
                      carries_counts=counts, meter_note=self.meter_note,
                      meter_shared=self.meter_shared)
        splitter = self.splitter
        if splitter is not None:
            common.update(meter=self.meter_name, predicted_joules=delta.predicted_joules,
                          idle_joules=delta.idle_joules, fitted_joules=delta.fitted_joules,
                          fallback_steps=delta.fallback_steps, ratios=splitter.ratios())
        if predictor is None:
            return StepHeader(source="none", bundle_id="none", predictor_ok=False, **common)
        interval = getattr(predictor, "interval", None)
        return StepHeader(
            source=predictor.source if splitter is None else self.meter_source,
            bundle_id=predictor.bundle_id, predictor_ok=True,
            interval=None if interval is None else (interval.lower, interval.upper),
            interval_level=None if interval is None else interval.level,
            interval_coverage=None if interval is None else interval.coverage, **common)

    def counts_due(self) -> bool:
        """Sparse mode: whether counts changed since they last went out (a batch without rows
        then carries the header anyway)."""
        return self._counts_changed

    def encode(self, req_ids: list[str]) -> bytes:
        """These requests' running totals as one block (`vllm_piep.runtime.record`), and
        remember that an output carried them."""
        self.evaluate()
        get = self._slots.get
        slots = np.fromiter((get(r, _ZERO_SLOT) for r in req_ids), np.intp, len(req_ids))
        block = self._rows[slots]
        self._rows[slots, _SENT] = block[:, _PREFILL] + block[:, _DECODE]
        self._rows[_ZERO_SLOT] = 0.0
        return encode_rows(block)

    def record(self, req_id: str) -> WireRecord:
        """A request's running total, decoded (for tests and tools; nothing is marked sent)."""
        self.evaluate()
        slot = self._slots.get(req_id, _ZERO_SLOT)
        return WireRecord.from_wire(self.header(counts=False),
                                    encode_rows(self._rows[slot:slot + 1]))

    def mark_incomplete(self, req_ids: Iterable[str]) -> None:
        """A step of these requests could not be accounted: their energy will be omitted."""
        self.evaluate()
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
        self.evaluate()  # its slot may be reused: its steps first
        self._counts_changed = True
        # Sparse mode: no output carried any of a request aborted from outside unless every
        # output carried its row; what it cost is the client's abort, not an unsent remainder.
        no_output = (self.sparse and self.splitter is None and not final
                     and req_id not in self.dense_ids)
        self.dense_ids.discard(req_id)
        slot = self._slots.pop(req_id, None)
        prompt = 0.0
        if slot is not None:
            row = self._rows[slot]
            left = float(row[_PREFILL] + row[_DECODE] - row[_SENT])
            if left < 0.0:
                # Warm-up energy taken back after an output had carried it: the API server
                # counts the request by that output, so it is not warm-up after all.
                self.warmup_joules += left
            elif aborted and no_output:
                self.aborted_joules += left
            elif aborted:
                self.unsent_joules += left
            else:
                self.after_finish_joules += left
            row[:] = 0.0
            self._last_seq[slot] = 0
            prompt = float(self._prompt[slot])
            self._prompt[slot] = 0.0
            self._free.append(slot)
        if self.splitter is not None:  # its steps waiting for the meter: unsent or not
            self._released[req_id] = aborted
            self._released.move_to_end(req_id)
            if len(self._released) > _MAX_RELEASED:
                self._released.popitem(last=False)
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
        self.evaluate()
        if self.steps - self._last_sweep < every:
            return
        self._last_sweep = self.steps
        live_set = set(live) | self.holding
        for req_id in [r for r in self._slots if r not in live_set]:
            self.release(req_id)

    @property
    def tracked_requests(self) -> int:
        self.evaluate()
        return len(self._slots)

    def _slot(self, req_id: str) -> int:
        slot = self._slots.get(req_id)
        if slot is None:
            if not self._free:
                old = self._rows.shape[0]
                grow = max(16, old)
                self._rows = np.vstack([self._rows, np.zeros((grow, _COLS))])
                self._prompt = np.concatenate([self._prompt, np.zeros(grow)])
                self._last_seq = np.concatenate([self._last_seq,
                                                 np.zeros(grow, dtype=np.int64)])
                self._free.extend(range(self._rows.shape[0] - 1, old - 1, -1))
            slot = self._free.pop()
            self._slots[req_id] = slot
            gone = self._gone.get(req_id) if self._gone else None
            if gone is not None:  # a late step of a released request: its prompt still counts
                self._prompt[slot] = gone.prompt
        return slot


def _warmup_part(increment: np.ndarray, fraction: float) -> np.ndarray:
    """The part of a step's shares that its warm-up time explains: that fraction of each
    request's static energy, taken from its prefill and decode columns in their proportion."""
    part = np.zeros_like(increment)
    static = increment[:, _STATIC] * fraction
    part[:, _STATIC] = static
    phases = increment[:, _PREFILL] + increment[:, _DECODE]
    share = np.divide(increment[:, _PREFILL], phases, out=np.zeros_like(phases),
                      where=phases > 0)
    part[:, _PREFILL] = static * share
    part[:, _DECODE] = static - part[:, _PREFILL]
    return part
