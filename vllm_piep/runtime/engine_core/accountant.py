"""Engine-side energy accounting: predict each step, split it among the step's requests, keep
each request's running total, and encode them for the trip to the API server. No vLLM imports:
the engine-core patches feed it plain numbers, as the scheduler holds them.

The engine loop does none of this: it queues the calls (`deferred.py`), which run off the loop,
in order. What they do is batched too. A served engine is `sparse`: its steps go into a log
(`_log`) as they are done, with the releases and held outputs between them, and the log is
evaluated in one pass (`evaluate`): the steps' requests mapped to their slots of the request
table (`request_table.py`), the predictor called once for every step of the log
(`StepGraph.run_many`: the prior's arithmetic in closed form, a bundle's too), then the steps'
shares added to the table in order, each release and held output applied where it was logged.
Evaluating `MAX_UNEVALUATED` steps at once costs about what evaluating one did: most of a step's
cost here is the cold caches the loop meets after each wait on the device, paid once per pass.

The log is evaluated when something reads the state: an output of a request whose every output
carries its row (`dense_ids`: the API server may finish it at a stop string), a record, the
number of requests held (`tracked_requests`), measured mode's meter reading (`settle`), the idle
engine; and when it holds `MAX_UNEVALUATED` steps. An output that finishes a request while steps
wait in the log is held (`hold`) and goes out once a pass has evaluated the steps before it, with
the total they gave it (`take_ready`): after `HOLD_S` at most while the engine is busy, at once
when it goes idle. Measured mode holds finished outputs until the meter speaks for their steps
(`measured.py`). An engine without an output queue (vLLM's in-process `LLM`) is dense: every
step is evaluated when done, by the predictor's step graph, alone.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from vllm_piep.meters.split import IntervalSplitter, PendingStep, Settled
from vllm_piep.model.flops import StepBatch
from vllm_piep.once import OnceLogger, logger
from vllm_piep.predict.attribution import prefill_fraction, split_step
from vllm_piep.predict.base import Predictor, StepInput
from vllm_piep.predict.stepgraph import N_OUT
from vllm_piep.runtime.engine_core.deferred import DeferredCalls
from vllm_piep.runtime.engine_core.request_table import SENT, ZERO_SLOT, RequestTable
from vllm_piep.runtime.engine_core.scheduled import (
    RawStep,
    ScheduledStep,
    StepColumns,
    step_batch,
    step_columns,
)
from vllm_piep.runtime.engine_core.warmup import WarmupDetector
from vllm_piep.runtime.record import COLUMN, ROW_FIELDS, StepHeader, WireRecord, encode_rows
from vllm_piep.runtime.worker.steptime import ENGINE_CLOCK, STEP_TIMERS

_MAX_PENDING_STEPS = 64  # scheduled but not yet updated steps (async scheduling, PP batch queue)
_PREFILL, _DECODE, _INCOMPLETE = COLUMN["prefill"], COLUMN["decode"], COLUMN["incomplete"]
_STATIC = COLUMN["static"]
_PREDICTED, _UNMEASURED = COLUMN["predicted"], COLUMN["unmeasured"]
_MAX_RELEASED = 4096  # released requests remembered for their steps still to be settled
# Sparse mode: steps the log holds at most before a pass evaluates them, and how long a
# finished request's output waits for that pass while the engine is busy.
MAX_UNEVALUATED = 16
HOLD_S = 0.05
# What the log holds, in order (the first element of each entry).
_STEP, _RELEASE, _HOLD = 0, 1, 2


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
    generations: np.ndarray  # the slots' generations then (`RequestTable.generation`)
    req_ids: list[str]
    increment: np.ndarray  # [N, N_OUT] predicted shares
    warmup_j: float  # predicted warm-up energy taken out of the shares


class Taken(NamedTuple):
    """A logged step, taken for its pass: what it computed, its time, when it was done."""

    step: RawStep | ScheduledStep
    step_ns: int
    now: int
    seq: int  # its number among the engine's steps (`steps` once it was counted)


class Mapped(NamedTuple):
    """A pass's steps as columns, mapped to their requests' slots."""

    columns: StepColumns
    slots: np.ndarray  # [M]
    prompt: np.ndarray  # [M] prompt lengths
    forget: set[str]  # released requests a step names late (`_forget_gone`)


class Ready(NamedTuple):
    """A held output a pass released: its client, the output, and the row it carries."""

    client: int
    output: Any
    row: np.ndarray


class EngineAccountant:
    """Per engine core: step predictions, per-request running totals, engine totals."""

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
            self._log.append((_STEP, pending, worker_step_ns, timer, now))
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

    def evaluate(self) -> None:
        """Sparse mode: evaluate the log (module docstring) in one pass. Its steps are
        converted and mapped to their slots together, and go to the predictor in one call; in
        prediction mode their shares are added as columns (`_apply_columns`), else step by
        step with each release and held output in the log's order (`_apply_in_order`). No
        slot is freed before the pass ends, so every step's requests keep the slots they were
        mapped to."""
        if not self._log:
            return
        log, self._log = self._log, []
        self._log_steps = 0
        self._oldest_hold_ns = None
        self._counts_changed = True
        taken: list[Taken | None] = []
        for entry in log:
            if entry[0] != _STEP:
                continue
            _, (made, scheduled_ns), worker_step_ns, timer, now = entry
            try:
                step = made() if callable(made) else made
                step_ns = self._step_ns(scheduled_ns, worker_step_ns, timer, now)
                taken.append(Taken(step, step_ns, now, self.steps))
            except Exception as exc:  # boundary: one bad step must not lose the others
                self._deferred_failed("evaluating a step", exc)
                taken.append(None)
        self.steps_evaluated += len(taken)
        good = [t for t in taken if t is not None]
        self._evaluating = True
        try:
            columns = self._columns(good)
            if columns is not None and self.warmup.ready:
                predicted = self._predict_columns(good, columns)
                if predicted is not None:
                    self._apply_columns(log, taken, columns, *predicted)
                    return
            self._apply_in_order(log, taken, columns)
        finally:
            self._evaluating = False
            self._free_emptied()
            self._expire_gone()

    def _columns(self, taken: list[Taken]) -> Mapped | None:
        """The pass's steps as columns, each request mapped to its slot (new requests get
        theirs and their prompt lengths), or None where they cannot be (then each step is
        mapped alone: only a bad step loses its energy)."""
        if not taken or any(len(t.step.req_ids) == 0 for t in taken):
            return None
        try:
            columns = step_columns([t.step for t in taken])
            table, gone = self.table, self._gone
            known = table.slots
            ids = columns.req_ids
            forget: set[str] = set()
            for t in taken:  # new requests first: the lookups below then find every one
                for req_id in t.step.new_prompts:
                    if req_id not in known:
                        self._slot(req_id)
            try:
                slots = np.fromiter(map(known.__getitem__, ids), np.intp, len(ids))
            except KeyError:  # new requests (or a released one's late step): theirs first
                for req_id in dict.fromkeys(r for r in ids if r not in known):
                    if gone and req_id in gone:
                        forget.add(req_id)
                    self._slot(req_id)
                slots = np.fromiter(map(known.__getitem__, ids), np.intp, len(ids))
            for t in taken:
                for req_id, n in t.step.new_prompts.items():
                    table.prompt[known[req_id]] = n
            prompt = table.prompt[slots]
            for k, given in columns.given:
                prompt[columns.starts[k]:columns.starts[k] + len(given)] = given
        except Exception as exc:  # boundary
            self._deferred_failed("mapping steps", exc)
            return None
        return Mapped(columns, slots, prompt, forget)

    def _predict_columns(self, taken: list[Taken], mapped: Mapped
                         ) -> tuple[np.ndarray, np.ndarray] | None:
        """Every step's shares [M, N_OUT] and joules [C, K] from one `run_many` call, or
        None where the predictor has no step graph or the call failed."""
        if self.predictor is None or self._run_many is None:
            return None
        try:
            requests, joules = self._run_many(
                mapped.columns.sched, mapped.prompt,
                np.array([t.step_ns for t in taken]) / 1e9, mapped.columns.starts)
        except Exception:  # boundary: each step is then predicted alone
            return None
        return requests.T, joules

    def _apply_columns(self, log: list[tuple[Any, ...]], taken: list[Taken | None],
                       mapped: Mapped, shares: np.ndarray, joules: np.ndarray) -> None:
        """Every step's shares added, then each release and held output applied as of its
        place in the log: the shares of the steps after it are taken out of its row for it
        (they are what a dense engine adds after the release: unsent or after-finish energy,
        `_free_emptied`). Measured mode: each step waits for the meter instead (`_defer`),
        and the releases follow (its rows get energy only when a step is settled)."""
        columns, slots = mapped.columns, mapped.slots
        starts = columns.starts
        ends = np.append(starts[1:], len(slots))
        good = [t for t in taken if t is not None]
        totals = joules.sum(axis=0)  # non-negative parts: finite iff every part is
        tokens = np.add.reduceat(columns.sched[1], starts)
        rows = self.table.rows
        detector = self.warmup
        measured = self.splitter is not None
        added = 0.0
        for k, t in enumerate(good):
            a, b = starts[k], ends[k]
            if not math.isfinite(totals[k]):
                self._step_failed(ValueError(f"non-finite step energy {joules[:, k]}"),
                                  t.step, slots[a:b], forget=False)
                shares[a:b] = 0.0
                continue
            seconds = t.step_ns / 1e9
            excess = detector.excess_s(float(tokens[k]), seconds)
            detector.observe(float(tokens[k]), seconds - excess)
            warmup_j = 0.0
            if excess > 0.0:
                moved = _warmup_part(shares[a:b], excess / seconds)
                shares[a:b] -= moved
                warmup_j = float(moved[:, _STATIC].sum())
                self._say_warmup(excess, seconds)
            if measured:
                self._seq = t.seq
                self._defer(t.step, slots[a:b], shares[a:b], warmup_j, float(totals[k]),
                            t.now - t.step_ns, t.now, forget=False)
            else:
                self.warmup_joules += warmup_j
                added += float(totals[k])
        if measured:
            self._release_in_order(log, mapped.forget)
            return
        self.total_joules += added
        # Each request's shares summed over the pass's steps, then added to its row once.
        order = np.argsort(slots, kind="stable")
        by_slot = slots[order]
        first = np.flatnonzero(np.concatenate(([True], by_slot[1:] != by_slot[:-1])))
        rows[by_slot[first], :N_OUT] += np.add.reduceat(shares[order], first, axis=0)
        # The releases and held outputs, each at its offset in the columns.
        last = np.full(len(rows), -1, dtype=np.intp)  # per slot, its last column
        last[by_slot] = order
        offset = 0
        forget = mapped.forget
        for entry, t in _walk(log, taken):
            kind = entry[0]
            if t is not None:
                offset += len(t.step.req_ids)
                if forget:
                    for req_id in forget.intersection(t.step.req_ids):
                        forget.discard(req_id)
                        self._release_at(offset, slots, shares, last, req_id,
                                         partial(self._forget, req_id))
            elif kind == _RELEASE:
                self._release_at(offset, slots, shares, last, entry[1],
                                 partial(self._release_now, entry[1], entry[2]))
            else:
                self._release_at(offset, slots, shares, last, entry[2].request_id,
                                 partial(self._ready, entry[1], entry[2]))

    def _release_in_order(self, log: list[tuple[Any, ...]], forget: set[str]) -> None:
        """Measured mode: the log's releases, in order, after its steps went to the meter;
        then the released requests its steps named late."""
        for entry in log:
            if entry[0] == _RELEASE:
                self._release_now(entry[1], entry[2])
            elif entry[0] == _HOLD:
                self._ready(entry[1], entry[2])
        for req_id in forget:
            self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        """A released request a step named late (`_forget_gone`)."""
        gone = self._gone.get(req_id)
        self._release_now(req_id, aborted=gone is None or gone.aborted, final=True)

    def _release_at(self, offset: int, slots: np.ndarray, shares: np.ndarray,
                    last: np.ndarray, req_id: str, release: Callable[[], None]) -> None:
        """`release` run on the request's row as it was at `offset` of the columns (`last`:
        each slot's last column)."""
        slot = self.table.slots.get(req_id)
        later = None
        if slot is not None and last[slot] >= offset:
            mine = slots[offset:] == slot
            later = shares[offset:][mine].sum(axis=0)
            self.table.rows[slot, :N_OUT] -= later
        release()
        if later is not None:  # the emptied slot holds what the steps after added
            self.table.rows[slot, :N_OUT] += later

    def _apply_in_order(self, log: list[tuple[Any, ...]], taken: list[Taken | None],
                        mapped: Mapped | None) -> None:
        """Step by step in the log's order, with each release and held output between
        (measured mode, warm-up still judged, a predictor without a step graph): each step
        predicted from one `run_many` call where it can be, else alone."""
        good = [t for t in taken if t is not None]
        results: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(good)
        if mapped is not None:
            predicted = self._predict_columns(good, mapped)
            if predicted is not None:
                shares, joules = predicted
                ends = np.append(mapped.columns.starts[1:], len(mapped.slots))
                results = [(shares[a:b], joules[:, k])
                           for k, (a, b) in enumerate(zip(mapped.columns.starts, ends,
                                                          strict=True))]
        j = -1
        for entry, t in _walk(log, taken):
            kind = entry[0]
            if t is not None:
                j += 1
                self._seq = t.seq
                try:
                    step = t.step if isinstance(t.step, ScheduledStep) \
                        else ScheduledStep.of_raw(t.step)
                    slots = (mapped.slots[mapped.columns.starts[j]:][:len(step.req_ids)]
                             if mapped is not None else self._slots_of(step))
                    result = results[j]
                    if result is None:
                        self._predict_step(step, slots, t.step_ns, t.now)
                    else:
                        self._add_predicted(step, slots, result[0], result[1], t.step_ns,
                                            t.now)
                except Exception as exc:  # boundary
                    self._deferred_failed("evaluating a step", exc)
            elif kind == _RELEASE:
                self._release_now(entry[1], entry[2])
            else:
                self._ready(entry[1], entry[2])

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
        if self._predictor is not None:
            self.errors += 1
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
                slot = self.table.slots.get(req_id)
                if slot is not None and req_id not in self._gone:
                    self.table.rows[slot, :N_OUT] -= part
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

    def _defer(self, step: ScheduledStep | RawStep, slots: np.ndarray, increment: np.ndarray,
               warmup_j: float, total: float, t0_ns: int, t1_ns: int,
               forget: bool = True) -> None:
        """A predicted step waits for the meter (step number `_seq`); `forget`: released
        requests it named are forgotten now (else by the caller)."""
        assert self.splitter is not None
        rows = self.table.rows
        rows[slots, _PREDICTED] += increment[:, _PREFILL] + increment[:, _DECODE]
        seq = self._seq
        self.table.last_seq[slots] = seq
        static = float(increment[:, _STATIC].sum()) + warmup_j
        self.splitter.add_step(PendingStep(
            t0_ns, t1_ns, static, max(0.0, total - static),
            StepPayload(seq, slots, self.table.generation[slots], step.req_ids, increment,
                        warmup_j)))
        if forget and self._gone:
            self._forget_gone(step.req_ids)

    def steps_in_flight(self) -> int:
        """Steps scheduled whose output has not come back."""
        return len(self._pending)

    def known_until_ns(self) -> int:
        """Up to when every step's time is known: now when no step is in flight, else the
        end of the last step done (a step in flight started after it). Call after
        `evaluate`: a logged step's time is known once it is evaluated."""
        if not self._pending:
            return self.now_ns()
        return self._last_done_ns or 0

    def settle(self, fallback_until_ns: int | None = None) -> int:
        """Settle the steps the meter's readings cover (or, with `fallback_until_ns`, the
        steps ended by then, by the fit): their measured energy goes into the rows of their
        requests. Returns how many steps were settled. Call with `lock` held. The steps in
        the log are not the meter's yet: they go to it with the log's pass, which a reading
        does not bring forward (a held output waits for it at most `HOLD_S`, `pass_due`);
        until then the readings are split up to the last step evaluated."""
        splitter = self.splitter
        if splitter is None:
            return 0
        if fallback_until_ns is None and not splitter.readings_waiting:
            return 0
        if fallback_until_ns is not None or not self._log_steps or self.pass_due():
            self.evaluate()
        if fallback_until_ns is None:
            done = splitter.settle(self._last_done_ns or 0 if self._log_steps
                                   else self.known_until_ns())
        else:
            done = splitter.fallback(fallback_until_ns)
        self._apply_settled(done)
        return len(done.steps)

    def _apply_settled(self, done: Settled) -> None:
        self.idle_joules += done.idle_j
        rows = self.table.rows
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
            mine = self.table.generation[slots] == payload.generations
            rows[slots[mine], :N_OUT] += scaled[mine]
            if step.fallback:
                increment = payload.increment[mine]
                rows[slots[mine], _UNMEASURED] += (increment[:, _PREFILL]
                                                   + increment[:, _DECODE])
            for i in np.flatnonzero(~mine):  # released since: no output will carry it
                joules = float(scaled[i, _PREFILL] + scaled[i, _DECODE])
                if self._released.get(payload.req_ids[i], True):
                    self.unsent_joules += joules
                else:
                    self.after_finish_joules += joules
            self.settled_seq = payload.seq

    def unsettled(self, req_id: str, done: int | None = None) -> bool:
        """Whether a step of the request still waits for the meter: one of the first `done`
        steps (when given) is still in the log, or a step it was in is not settled yet."""
        if done is not None and done > self.steps_evaluated:
            return True
        slot = self.table.slots.get(req_id)
        return slot is not None and int(self.table.last_seq[slot]) > self.settled_seq

    def _forget_gone(self, req_ids: list[str]) -> None:
        """Requests released while a step of theirs ran: no output will carry this step's
        share. An aborted request's share is unsent energy; a finished one's (async
        scheduling had already put it into this step) is after-finish energy. Neither may stay
        tracked."""
        for req_id in self._gone.keys() & set(req_ids):
            self._release_now(req_id, aborted=self._gone[req_id].aborted, final=True)

    def _expire_gone(self) -> None:
        """Released requests no step still in flight can name: forgotten."""
        oldest = self.steps - _MAX_PENDING_STEPS
        if self._gone:
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

    # -- counts and records ------------------------------------------------------------------
    def counts(self, evaluate: bool = True) -> Counts:
        """The engine's counts, after evaluating the log (`evaluate`), else as of the last
        pass."""
        if evaluate:
            self.evaluate()
        return Counts(self.total_joules, self.errors, self.unsent_joules, self.aborted_joules,
                      self.after_finish_joules, self.warmup_joules, self.predicted_joules,
                      self.idle_joules, self.fitted_joules, self.fallback_steps,
                      tuple(self.steps_by_timer.values()))

    def unreported(self) -> bool:
        """Whether some count has not gone out yet (the idle flush asks)."""
        return self.counts() != self._reported

    def header(self, counts: bool = True) -> StepHeader:
        """Who predicted; with `counts`, the engine's counts since they last went out, as of
        the log's last pass (each increment goes out once: the caller sends this header to
        one API server), else zeros."""
        predictor = self._predictor
        if counts:
            with self._counts_lock:
                now, before = self.counts(evaluate=False), self._reported
                self._reported = now
                self._counts_changed = False
            delta = Counts(*(a - b for a, b in zip(now[:-1], before[:-1], strict=True)),
                           tuple(a - b for a, b in zip(now.steps_by_timer, before.steps_by_timer,
                                                       strict=True)))
            tracked = len(self.table)
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

    # -- held outputs (prediction mode) ------------------------------------------------------
    def holds_outputs(self) -> bool:
        """Whether a finishing output waits for the log's next pass (module docstring)."""
        return (self.sparse and self.splitter is None and self.put_outputs is not None
                and self._log_steps > 0)

    def hold(self, client: int, output: Any) -> None:
        """A finishing output waits in the log: the pass that evaluates the steps before it
        releases it with its total (`take_ready`)."""
        self._log.append((_HOLD, client, output))
        self.holding.add(output.request_id)
        self.note_hold()

    def note_hold(self) -> None:
        """An output is held for the log's steps (here, or for the meter, `measured.py`):
        the pass is due `HOLD_S` from the first such."""
        if self._oldest_hold_ns is None and self._log_steps:
            self._oldest_hold_ns = self.now_ns()

    def pass_due(self) -> bool:
        """Whether a held output has waited `HOLD_S` for the log's pass."""
        oldest = self._oldest_hold_ns
        return oldest is not None and (self.now_ns() - oldest) / 1e9 >= HOLD_S

    def _ready(self, client: int, output: Any) -> None:
        """A held output's turn in the pass: its total as of the steps before it (marked sent,
        as `encode` does), then its release, as when it would have gone out at once."""
        req_id = output.request_id
        table = self.table
        slot = table.slots.get(req_id, ZERO_SLOT)
        row = table.rows[slot, :len(ROW_FIELDS)].copy()
        if slot != ZERO_SLOT:
            table.rows[slot, SENT] = row[_PREFILL] + row[_DECODE]
        self.holding.discard(req_id)
        self._release_now(req_id, aborted=False)
        self.ready.append(Ready(client, output, row))

    def take_ready(self) -> list[Ready]:
        ready, self.ready = self.ready, []
        return ready

    # -- per request -------------------------------------------------------------------------
    def release(self, req_id: str, aborted: bool = True, final: bool = False) -> None:
        """The engine is done with the request (`aborted`: from outside, with no final
        output, possibly while a step of it runs; else it finished with this output). Energy
        no output carried is counted as unsent (aborted) or after-finish (finished), so the
        engine's totals still add up. `final`: a gone request's late step was accounted. With
        steps in the log, the release takes its place after them."""
        if aborted and self._held is not None and not final:  # its output still goes out
            self._held.append(req_id)
            return
        if self._log and not final:
            self._log.append((_RELEASE, req_id, aborted))
            return
        self._release_now(req_id, aborted, final)

    def _release_now(self, req_id: str, aborted: bool = True, final: bool = False) -> None:
        self._counts_changed = True
        # Sparse mode: no output carried any of a request aborted from outside unless every
        # output carried its row; what it cost is the client's abort, not an unsent remainder.
        no_output = self.sparse and not final and req_id not in self.dense_ids
        self.dense_ids.discard(req_id)
        table = self.table
        slot = table.slots.pop(req_id, None)
        prompt = 0.0
        if slot is not None:
            row = table.rows[slot]
            left = float(row[_PREFILL] + row[_DECODE] - row[SENT])
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
            prompt = float(table.prompt[slot])
            table.reset(slot)
            if self._evaluating:  # a later step of this pass may still add to it
                self._emptied.append((slot, aborted))
            else:
                table.free.append(slot)
        if self.splitter is not None:  # its steps waiting for the meter: unsent or not
            self._released[req_id] = aborted
            self._released.move_to_end(req_id)
            if len(self._released) > _MAX_RELEASED:
                self._released.popitem(last=False)
        if aborted or self._pending:  # a step already scheduled may still name it
            gone = self._gone.get(req_id)
            self._gone[req_id] = Gone(self.steps, aborted,
                                      prompt if gone is None or prompt else gone.prompt)

    def _free_emptied(self) -> None:
        """The slots released during a pass: what later steps of the pass added to them went
        to no output (a late step's share: unsent or after-finish); then they are free."""
        emptied, self._emptied = self._emptied, []
        table = self.table
        for slot, aborted in emptied:
            row = table.rows[slot]
            left = float(row[_PREFILL] + row[_DECODE])
            if left:
                if aborted:
                    self.unsent_joules += left
                else:
                    self.after_finish_joules += left
            table.reset(slot)
            table.free.append(slot)

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
        if self.steps_done - self._last_sweep < every:
            return
        self._last_sweep = self.steps_done
        live_set = set(live) | self.holding
        for req_id in [r for r in self.table.slots if r not in live_set]:
            self.release(req_id)

    @property
    def tracked_requests(self) -> int:
        self.evaluate()
        return len(self.table)


def _walk(log: list[tuple[Any, ...]], taken: list[Taken | None]
          ) -> Iterator[tuple[tuple[Any, ...], Taken | None]]:
    """The log's entries in order, each step with what was taken of it (steps that could not
    be taken are left out; other entries come with None)."""
    steps = iter(taken)
    for entry in log:
        if entry[0] != _STEP:
            yield entry, None
        elif (t := next(steps)) is not None:
            yield entry, t


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
