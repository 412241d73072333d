"""Engine-side energy accounting: predict each step, split it among the step's requests, keep
each request's running total, and encode them for the trip to the API server. No vLLM imports:
the engine-core patches feed it plain numbers, as the scheduler holds them.

The engine loop does none of this: it queues the calls (`deferred.py`), which run off the loop,
in order. What they do is batched too. A served engine is `sparse`: its steps go into a log as
they are done, with the releases and held outputs between them, and the log is evaluated in
one pass (`log_pass.py`): the steps' requests mapped to their slots of the request table
(`request_table.py`), the predictor called once for every step of the log
(`StepGraph.run_many`: the prior's arithmetic in closed form, a bundle's too), then the steps'
shares added to the table as columns, each release (`releases.py`) and held output
(`held_outputs.py`) applied where it was logged.

The log is evaluated when something reads the state: an output of a request whose every output
carries its row (`dense_ids`: the API server may finish it at a stop string), a record, the
number of requests held (`tracked_requests`), measured mode's meter reading (`settle`,
`measured_settlement.py`), the idle engine; and when it holds `MAX_UNEVALUATED` steps. An
engine without an output queue (vLLM's in-process `LLM`) is dense: every step is evaluated when
done, by the predictor's step graph, alone. A step's warm-up energy is taken out of its shares
(`warmup_shares.py`); the engine's counts go out in the step header (`engine_counts.py`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from vllm_piep.meters.split import IntervalSplitter
from vllm_piep.model.flops import StepBatch
from vllm_piep.once import OnceLogger, logger
from vllm_piep.predict.attribution import prefill_fraction, split_step
from vllm_piep.predict.base import Predictor, StepInput
from vllm_piep.predict.stepgraph import N_OUT
from vllm_piep.runtime.engine_core.deferred import DeferredCalls
from vllm_piep.runtime.engine_core.engine_counts import Counts, EngineCounts
from vllm_piep.runtime.engine_core.held_outputs import HOLD_S, HeldOutputs, Ready
from vllm_piep.runtime.engine_core.log_pass import MAX_UNEVALUATED, STEP_ENTRY, LogPass
from vllm_piep.runtime.engine_core.measured_settlement import MeasuredSettlement
from vllm_piep.runtime.engine_core.releases import MAX_PENDING_STEPS, Gone, Releases
from vllm_piep.runtime.engine_core.request_table import SENT, ZERO_SLOT, RequestTable
from vllm_piep.runtime.engine_core.scheduled import (
    RawStep,
    ScheduledStep,
    step_batch,
)
from vllm_piep.runtime.engine_core.warmup import WarmupDetector
from vllm_piep.runtime.engine_core.warmup_shares import Suspect, WarmupShares
from vllm_piep.runtime.record import COLUMN, WireRecord, encode_rows
from vllm_piep.runtime.worker.steptime import ENGINE_CLOCK, STEP_TIMERS

_PREFILL, _DECODE, _INCOMPLETE = COLUMN["prefill"], COLUMN["decode"], COLUMN["incomplete"]

__all__ = ["HOLD_S", "MAX_UNEVALUATED", "EngineAccountant", "Ready"]


class EngineAccountant(LogPass, HeldOutputs, Releases, WarmupShares, MeasuredSettlement,
                       EngineCounts):
    """Per engine core: step predictions, per-request running totals, engine totals. Its parts,
    one module each: the log's pass (`log_pass.py`), held outputs (`held_outputs.py`),
    releases (`releases.py`), warm-up (`warmup_shares.py`), measured mode's settlement
    (`measured_settlement.py`), the counts and header (`engine_counts.py`)."""

    def __init__(self, make_predictor: Callable[[], Predictor], engine_id: str = "0",
                 clock_ns: Callable[[], int] = time.perf_counter_ns) -> None:
        self._make_predictor = make_predictor
        self._predictor: Predictor | None = None
        self._predictor_failed = False
        self._run_step: Callable | None = None
        self._run_many: Callable | None = None  # several steps in one call
        self.engine_id = engine_id
        # The accountant's clock (the loop reads it when it queues a step's calls): a plain
        # attribute, one lookup fewer than a method on the loop's critical path.
        self.now_ns = clock_ns
        self.table = RequestTable()
        self._pending: dict[int, tuple[ScheduledStep | Callable[[], ScheduledStep], int]] = {}
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
        self._seq = 0  # the number of the step being added (measured mode's settlement order)
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
        self._released: OrderedDict[str, bool] = OrderedDict()  # req id -> aborted
        self.holding: set[str] = set()  # finished requests whose output is held
        self.engine_meter: Any = None  # measured.EngineMeter, once started
        self.meter_tried = False
        self.meter_note: str | None = None  # why not measured mode, where a meter was to serve
        self.meter_shared = 0  # others' processes on the metered GPUs (-1: cannot tell)
        # The engine loop's calls, run off the loop in order (`deferred.py`); run them with
        # `lock` held before reading the state they change.
        self.deferred = DeferredCalls(self._deferred_failed)
        self.loop_steps = 0  # steps updated (every `_SWEEP_EVERY`, a sweep is due: `LoopHandle`)
        # Requests vLLM finished inside the update being accounted (errors), until its call.
        self.errored_in_update: list[str] = []
        # Sparse mode (module docstring): set by the served engine.
        self.sparse = False
        self.dense_ids: set[str] = set()  # requests whose every output carries its row
        # The log: steps done, releases and held outputs, in order, not evaluated yet.
        self._log: list[tuple[Any, ...]] = []
        self._log_steps = 0
        self._oldest_hold_ns: int | None = None
        self.steps_done = 0  # steps done so far; of them, evaluated:
        self.steps_evaluated = 0
        self._evaluating = False  # a pass runs: released slots are freed at its end
        self._emptied: list[tuple[int, bool]] = []  # (slot, aborted) to free after the pass
        self.ready: list[Ready] = []  # held outputs a pass released, to go out
        # The engine's output queue for held outputs, `(client, outputs)`: set by a served
        # engine (None: nothing is held, a finishing output evaluates the log at once).
        self.put_outputs: Callable[[int, list[Any]], None] | None = None
        self._counts_changed = False  # since the counts last went out (sparse mode)

    def _deferred_failed(self, call: str, exc: BaseException) -> None:
        self.errors += 1
        self._once.warn(f"accounting a step ({call})", exc,
                        "energy of the affected requests may be missing")

    @property
    def predictor(self) -> Predictor | None:
        if self._predictor is None and not self._predictor_failed:
            try:
                self._predictor = self._make_predictor()
                self._run_step = getattr(self._predictor, "run_step", None)
                self._run_many = getattr(getattr(self._predictor, "graph", None), "run_many",
                                         None)
            except Exception as exc:  # boundary: a bad predictor must not stop serving
                self._predictor_failed = True  # each step then fails (`_step_failed` counts)
                self._once.warn("loading the energy predictor", exc,
                                "responses will carry no usage.energy")
        return self._predictor

    def on_schedule(self, key: int,
                    step: ScheduledStep | Callable[[], ScheduledStep] | list[str],
                    batch: StepBatch | None = None, at_ns: int | None = None) -> None:
        """A step was scheduled (at `at_ns`, else now); its work is known now, its duration
        when it is done. A `ScheduledStep` (or what makes it, called when the step is
        evaluated), or request ids and their `StepBatch`."""
        if isinstance(step, list):
            assert batch is not None, "request ids need their StepBatch"
            step = ScheduledStep.of_batch(step, batch)
        if len(self._pending) >= MAX_PENDING_STEPS:  # never grows without bound
            self._pending.pop(next(iter(self._pending)))
        self._pending[key] = (step, self.now_ns() if at_ns is None else at_ns)

    def on_step_done(self, key: int, worker_step_ns: int | None = None,
                     timer: str | None = None, at_ns: int | None = None) -> None:
        """The step's model output arrived (at `at_ns`, else now): its evaluation is logged
        (sparse), or it is predicted and its shares added now (dense).

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
        self.steps_done += 1
        if self.sparse:
            # Keys are ids of vLLM's scheduler outputs, reused once freed: the step leaves
            # `_pending` now, its evaluation waits in the log.
            self._log.append((STEP_ENTRY, pending, worker_step_ns, timer, now))
            self._log_steps += 1
            if self._log_steps >= MAX_UNEVALUATED:
                self.evaluate()
            return
        self.steps_evaluated += 1
        made, scheduled_ns = pending
        step = made() if callable(made) else made
        if not isinstance(step, ScheduledStep):
            step = ScheduledStep.of_raw(step)
        step_ns = self._step_ns(scheduled_ns, worker_step_ns, timer, now)
        self._seq = self.steps
        self._predict_step(step, self._slots_of(step), step_ns, now)
        self._expire_gone()

    def _predict_step(self, step: ScheduledStep, slots: np.ndarray, step_ns: int, now: int
                      ) -> None:
        """One step alone: predicted, split, added."""
        predictor = self.predictor
        try:
            if predictor is None:
                raise RuntimeError("no predictor")
            prompt = self.table.prompt[slots][None, :] if step.prompt is None else step.prompt
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

    def _step_failed(self, exc: BaseException, step: ScheduledStep | RawStep,
                     slots: np.ndarray, forget: bool = True) -> None:
        """A step that could not be predicted: its requests' energy is incomplete (no
        predictor: said once when loading it). `forget`: released requests it named are
        forgotten now (else by the caller)."""
        self.errors += 1  # piep_predictor_errors_total: steps whose prediction failed
        if self._predictor is not None:
            self._once.warn("predicting a step's energy", exc,
                            "the requests in that step get no usage.energy")
        self.table.rows[slots, _INCOMPLETE] = 1.0
        if forget and self._gone:
            self._forget_gone(step.req_ids)

    def _add_step(self, step: ScheduledStep, slots: np.ndarray, increment: np.ndarray,
                  total: float, step_ns: int, now: int) -> None:
        """A predicted step's shares into its requests' rows (measured mode: to the meter)."""
        increment, warmup_j = self._take_warmup(step, increment, step_ns / 1e9)
        if self.splitter is not None:
            self._defer(step, slots, increment, warmup_j, total, now - step_ns, now)
            return
        self.table.rows[slots, :N_OUT] += increment  # a request appears once per step
        self.total_joules += total
        self.warmup_joules += warmup_j
        if self._gone:
            self._forget_gone(step.req_ids)

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
        """The requests' rows, as an index array; a released request's late step takes a
        new row with its prompt length (its share then goes to an outcome)."""
        table = self.table
        ids = step.req_ids
        known = table.slots
        try:
            slots = np.fromiter(map(known.__getitem__, ids), np.intp, len(ids))
        except KeyError:  # new requests: their slots first (may grow the arrays)
            for req_id in [r for r in ids if r not in known]:
                self._slot(req_id)
            slots = np.fromiter(map(known.__getitem__, ids), np.intp, len(ids))
        for req_id, n in step.new_prompts.items():
            table.prompt[table.slots[req_id]] = n
        return slots

    def _slot(self, req_id: str) -> int:
        table = self.table
        known = req_id in table.slots
        slot = table.slot(req_id)
        if not known:
            gone = self._gone.get(req_id) if self._gone else None
            if gone is not None:  # a late step of a released request: its prompt still counts
                table.prompt[slot] = gone.prompt
        return slot

    def encode(self, req_ids: list[str]) -> bytes:
        """These requests' running totals as one block (`vllm_piep.runtime.record`), after
        evaluating the log, and remember that an output carried them."""
        if req_ids:
            self.evaluate()
        table = self.table
        get = table.slots.get
        slots = np.fromiter((get(r, ZERO_SLOT) for r in req_ids), np.intp, len(req_ids))
        block = table.rows[slots]
        table.rows[slots, SENT] = block[:, _PREFILL] + block[:, _DECODE]
        table.rows[ZERO_SLOT] = 0.0
        return encode_rows(block)

    def record(self, req_id: str) -> WireRecord:
        """A request's running total, decoded (for tests and tools; nothing is marked sent)."""
        self.evaluate()
        slot = self.table.slots.get(req_id, ZERO_SLOT)
        return WireRecord.from_wire(self.header(counts=False),
                                    encode_rows(self.table.rows[slot:slot + 1]))

    def mark_incomplete(self, req_ids: Iterable[str]) -> None:
        """A step of these requests could not be accounted: their energy will be omitted."""
        self.evaluate()
        for req_id in req_ids:
            slot = self._slot(req_id)  # may grow (replace) the array: index it afterwards
            self.table.rows[slot, _INCOMPLETE] = 1.0

    @property
    def tracked_requests(self) -> int:
        self.evaluate()
        return len(self.table)
