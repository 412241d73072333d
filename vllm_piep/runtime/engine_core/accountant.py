"""Engine-side energy accounting: predict each step, split it among the step's requests, keep
each request's running total, and encode them for the trip to the API server. No vLLM imports:
the engine-core patches feed it plain numbers, as the scheduler holds them.

The engine loop does none of this: it queues the calls (`deferred.py`), which run off the loop,
in order. Each step is accounted at its own update (`on_step_done`), so a request's total
through its last step is known when its final output goes out: nothing waits for the plugin.

The split is the predictor's rule (`predict/split_rule.py`): linear in each request's features
given the step. Requests in a run of one-token decode steps get theirs in closed form
(`decode_runs.py`: O(1) per step, whatever the batch); the rest of a step (new, prefilling,
resumed, speculative, late requests) is split explicitly, O(their count). Cheap checks on the
scheduler's lists say whether a step's cached requests are exactly the runs' members, each one
token on (`_regular`); a step that breaks the pattern is split explicitly for every request,
and every `AUDIT_EVERY` steps an explicit split checks what the cheap checks accepted (a
disagreement is counted, logged once, and ends the closed form). A predictor without a split
rule (`PIEP_PREDICTOR`) predicts each step whole (`_predict_step`).

Its parts, one module each: the request table (`request_table.py`), the decode runs, releases
(`releases.py`), warm-up (`warmup_shares.py`), measured mode's settlement
(`measured_settlement.py`), the counts and header (`engine_counts.py`). An engine that sends
outputs (`sparse`) gives rows only to the outputs that finish a request and to every output
of a request with stop strings (`dense_ids`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from itertools import compress, islice
from operator import not_
from typing import Any

import numpy as np

from vllm_piep.meters.split import IntervalSplitter
from vllm_piep.model.components import STATIC
from vllm_piep.model.flops import StepBatch
from vllm_piep.once import OnceLogger, logger
from vllm_piep.predict.attribution import prefill_fraction, split_step
from vllm_piep.predict.base import LinearSplit, Predictor, StepInput
from vllm_piep.predict.split_rule import (
    DECODE_U,
    DECODE_V,
    ROWS,
    TOKENS,
    SplitRule,
    base_features,
    decode_terms,
    phases,
)
from vllm_piep.predict.stepgraph import N_OUT
from vllm_piep.runtime.engine_core.decode_runs import DecodeRuns
from vllm_piep.runtime.engine_core.deferred import DeferredCalls
from vllm_piep.runtime.engine_core.engine_counts import Counts, EngineCounts
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
AUDIT_EVERY = 256  # steps between explicit checks of what the cheap checks accepted

__all__ = ["AUDIT_EVERY", "EngineAccountant"]


class EngineAccountant(Releases, WarmupShares, MeasuredSettlement, EngineCounts):
    """Per engine core: step predictions, per-request running totals, engine totals (module
    docstring)."""

    def __init__(self, make_predictor: Callable[[], Predictor], engine_id: str = "0",
                 clock_ns: Callable[[], int] = time.perf_counter_ns,
                 split_rule: bool = True) -> None:
        """`split_rule`: False predicts every step whole through the predictor's step graph
        (the reference the split rule and its closed form are tested against)."""
        self._use_rule = split_rule
        self._make_predictor = make_predictor
        self._predictor: Predictor | None = None
        self._predictor_failed = False
        self._run_step: Callable | None = None
        self._rule: SplitRule | None = None  # the predictor's split rule, where it has one
        self.engine_id = engine_id
        # The accountant's clock (the loop reads it when it queues a step's calls): a plain
        # attribute, one lookup fewer than a method on the loop's critical path.
        self.now_ns = clock_ns
        self.table = RequestTable()
        self.runs: DecodeRuns | None = None  # the closed form, once the predictor has a rule
        self.regular_steps = 0  # steps whose cached requests all went on in their runs
        self.audits = 0  # explicit checks of the cheap checks (`AUDIT_EVERY`)
        self.audit_failures = 0  # of them, disagreements (the closed form then ends)
        self._pending: dict[int, tuple[ScheduledStep | Callable[[], ScheduledStep], int]] = {}
        # Released requests: vLLM aborts requests between a step's scheduling and its update,
        # and with async scheduling a request that finishes is already in the next step.
        self._gone: dict[str, Gone] = {}
        self._deferred_releases: list[str] | None = None  # aborts waiting for this update
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
        self._counts_sent_ns = 0
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
        self.waiting: set[str] = set()  # measured mode: finished requests whose output waits
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
        # An engine that sends outputs: only the outputs that finish a request, and those of
        # requests with stop strings (`dense_ids`: the API server may finish them), carry rows.
        self.sparse = False
        self.dense_ids: set[str] = set()
        self.steps_done = 0  # steps whose output came back
        # The engine's output queue, `(client, outputs)`: set by a served engine (measured
        # mode sends outputs that waited for the meter on it).
        self.put_outputs: Callable[[int, list[Any]], None] | None = None

    def _deferred_failed(self, call: str, exc: BaseException) -> None:
        self.errors += 1
        self._once.warn(f"accounting a step ({call})", exc,
                        "energy of the affected requests may be missing")

    @property
    def predictor(self) -> Predictor | None:
        if self._predictor is None and not self._predictor_failed:
            try:
                predictor = self._make_predictor()
                self._run_step = getattr(predictor, "run_step", None)
                if self._use_rule and isinstance(predictor, LinearSplit):
                    self._rule = predictor.split_rule()
                if self._rule is not None:
                    self.runs = DecodeRuns(self.table, self._rule.n_components)
                self._predictor = predictor
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
        accounted), or request ids and their `StepBatch`."""
        if isinstance(step, list):
            assert batch is not None, "request ids need their StepBatch"
            step = ScheduledStep.of_batch(step, batch)
        if len(self._pending) >= MAX_PENDING_STEPS:  # never grows without bound
            self._pending.pop(next(iter(self._pending)))
        self._pending[key] = (step, self.now_ns() if at_ns is None else at_ns)

    def on_step_done(self, key: int, worker_step_ns: int | None = None,
                     timer: str | None = None, at_ns: int | None = None) -> None:
        """The step's model output arrived (at `at_ns`, else now): it is predicted and its
        shares added to its requests' rows (measured mode: it waits for the meter).

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
        made, scheduled_ns = pending
        step_ns = self._step_ns(scheduled_ns, worker_step_ns, timer, now)
        self._seq = self.steps
        try:
            step = made() if callable(made) else made
        except Exception as exc:  # boundary: one bad step must not lose the others
            self._deferred_failed("reading a step", exc)
            return
        if self.predictor is not None and self._rule is not None:
            self._account(step, step_ns, now)
        else:
            if not isinstance(step, ScheduledStep):
                step = ScheduledStep.of_raw(step)
            self._predict_step(step, self._slots_of(step), step_ns, now)
        self._expire_gone()

    # -- a step by the split rule ---------------------------------------------------------------
    def _closed_form(self, step: RawStep | ScheduledStep) -> DecodeRuns | None:
        """The decode runs, where this step may use them: a step as vLLM's lists give it, in
        prediction mode, once warm-up can be judged (the first steps' shares are kept apart,
        `warmup_shares.py`)."""
        runs = self.runs
        if runs is None or type(step) is not RawStep or self.splitter is not None \
                or not self.warmup.ready:
            return None
        return runs

    def _regular(self, raw: RawStep, runs: DecodeRuns) -> list[int] | None:
        """Whether every member of the runs still in one is in the step, one token on from its
        expected context: the positions of the others (cached non-members, then the new
        requests), to split explicitly; else None. Members with speculative tokens, and
        members the step does not schedule (preempted, or no room), leave their runs first.
        Checks at C speed on vLLM's lists: the cached non-members' count leaves room for every
        member; the cached requests' tokens less the non-members' number one per member; their
        contexts less the non-members' sum to the members' expected sum."""
        members = runs.members
        spec = raw.spec_tokens
        if spec:
            for req_id in [r for r in spec if r in members]:
                runs.leave(req_id)
        cached_start = raw.start[0]
        nc = len(cached_start)
        ids = raw.req_ids
        others = list(compress(range(nc), map(not_, map(members.__contains__,
                                                          islice(ids, nc)))))
        if nc - len(others) < len(members):
            here = set(islice(ids, nc))
            for req_id in [r for r in members if r not in here]:
                runs.leave(req_id)
        if nc - len(others) != len(members):
            return None
        scheduled = raw.scheduled
        tokens = sum(map(scheduled.__getitem__, islice(ids, nc)))
        if others:
            tokens -= sum(scheduled[ids[i]] for i in others)
            context = sum(cached_start) - sum(cached_start[i] for i in others)
        else:
            context = sum(cached_start)
        if tokens != len(members) or context != runs.expected_context():
            return None
        others.extend(range(nc, len(ids)))
        return others

    def _account(self, step: RawStep | ScheduledStep, step_ns: int, now: int) -> None:
        """One step by the split rule (module docstring)."""
        rule = self._rule
        assert rule is not None
        runs = self._closed_form(step)
        explicit: list[int] | None = None
        audit = False
        if runs is not None:
            explicit = self._regular(step, runs)  # type: ignore[arg-type]
            if explicit is not None and runs.j % AUDIT_EVERY == AUDIT_EVERY - 1:
                explicit, audit = None, True
        regular = explicit is not None
        self.regular_steps += regular
        if regular and not explicit and self._decode_step(runs, step_ns):  # type: ignore[arg-type]
            return
        ids, sched, prompt_given = _explicit_part(step, explicit)
        try:
            slots = self._slots_for(ids, step.new_prompts)
        except Exception as exc:  # boundary
            self._deferred_failed("mapping a step's requests", exc)
            return
        prompt = self.table.prompt[slots] if prompt_given is None else prompt_given
        seconds = step_ns / 1e9
        try:
            base = base_features(sched, prompt)
            sums = base.sum(axis=1)
            if regular:
                assert runs is not None
                sums += len(runs) * DECODE_U + runs.expected_context() * DECODE_V
            split = rule.coefficients(sums, seconds)
            total = float(split.joules.sum())  # non-negative parts: finite iff every part is
            if not math.isfinite(total):
                raise ValueError(f"non-finite step energy {split.joules}")
        except Exception as exc:  # boundary
            self._step_failed(exc, step, slots)
            if runs is not None:
                self._runs_failed(runs, regular)
            return
        per_feature = split.per_feature
        increment = np.empty((N_OUT, len(ids)))
        warmup_j = 0.0
        if runs is not None:  # warm-up judged: its energy leaves the split's static part
            excess = self.warmup.excess_s(float(sums[TOKENS]), seconds)
            self.warmup.observe(float(sums[TOKENS]), seconds - excess)
            if excess > 0.0:
                fraction = excess / seconds
                warmup_j = float(split.joules[STATIC]) * fraction
                per_feature[STATIC] *= 1.0 - fraction
                self._say_warmup(excess, seconds)
        np.matmul(per_feature, base, out=increment[2:])
        phases(increment, base)
        shares = increment.T
        if runs is None:
            shares, warmup_j = self._take_warmup(ids, float(sums[TOKENS]), shares, seconds)
        if self.splitter is not None:
            self._defer(step, slots, shares, warmup_j, total, now - step_ns, now, ids=ids)
            return
        self.table.rows[slots, :N_OUT] += shares  # a request appears once per step
        self.total_joules += total
        self.warmup_joules += warmup_j
        if runs is not None:
            runs.push(decode_terms(per_feature) if regular else None)
            self._follow_runs(runs, ids, sched, base, slots, regular, audit)
        elif self.runs is not None and self.runs.members:
            self.runs.leave_all()  # measured mode, or warm-up: explicit from here
        if self._gone:
            self._forget_gone(ids)

    def _decode_step(self, runs: DecodeRuns, step_ns: int) -> bool:
        """A step of the runs' members alone (`_account`'s common case), in a few operations:
        False where the split rule cannot fold it (then `_account` goes on)."""
        seconds = step_ns / 1e9
        d = len(runs)
        try:
            folded = self._rule.decode_step(d, runs.expected_context(), seconds)  # type: ignore[union-attr]
            if folded is None:
                return False
            terms, joules = folded
            total = float(joules.sum())
            if not math.isfinite(total):
                raise ValueError(f"non-finite step energy {joules}")
        except Exception as exc:  # boundary
            self.errors += 1
            self._once.warn("predicting a step's energy", exc,
                            "the requests in that step get no usage.energy")
            self._runs_failed(runs, True)
            return True
        warmup = self.warmup
        excess = warmup.excess_s(float(d), seconds)
        warmup.observe(float(d), seconds - excess)
        warmup_j = 0.0
        if excess > 0.0:
            fraction = excess / seconds
            warmup_j = float(joules[STATIC]) * fraction
            terms[STATIC] *= 1.0 - fraction
            self._say_warmup(excess, seconds)
        runs.push(terms)
        self.total_joules += total
        self.warmup_joules += warmup_j
        return True

    def _slots_for(self, ids: list[str], new_prompts: dict[str, int]) -> np.ndarray:
        """The requests' slots (new ones get theirs, with their prompt lengths); a released
        request's late step takes a new slot with its prompt length (its share then goes to
        an outcome)."""
        table = self.table
        known = table.slots
        try:
            slots = np.fromiter(map(known.__getitem__, ids), np.intp, len(ids))
        except KeyError:  # new requests (or a released one's late step): theirs first
            for req_id in [r for r in ids if r not in known]:
                self._slot(req_id)
            slots = np.fromiter(map(known.__getitem__, ids), np.intp, len(ids))
        for req_id, n in new_prompts.items():
            table.prompt[known[req_id]] = n
        return slots

    def _follow_runs(self, runs: DecodeRuns, ids: list[str], sched: np.ndarray,
                     base: np.ndarray, slots: np.ndarray, regular: bool, audit: bool) -> None:
        """After a step's shares: which requests decode one token at each step from the next
        (they join a run), and, after a step split explicitly for every request, which members
        did not go one token on (they leave their run; where they decode next, they join a new
        one), and which were not scheduled (they leave theirs)."""
        members = runs.members
        nxt = sched[0] + sched[1]  # each request's context at its next step
        decodes = (base[ROWS] > 0) & (sched[3] == 1.0)
        if regular:  # the explicit ones are not members
            for i in np.flatnonzero(decodes):
                req_id = ids[i]
                if req_id not in self._gone:
                    runs.join(req_id, int(slots[i]), float(nxt[i]))
            return
        j_before = runs.j - 1
        table = self.table
        member_slot = np.fromiter((members.get(r, -1) for r in ids), np.intp, len(ids))
        is_member = member_slot >= 0
        expected = np.where(is_member, table.run_s0[member_slot] + (j_before
                                                                   - table.run_j0[member_slot]),
                            -1.0)
        going_on = is_member & (sched[1] == 1.0) & decodes & (sched[0] == expected)
        stray = is_member & ~going_on
        missing = len(members) - int(is_member.sum())
        if audit:
            self.audits += 1
            if stray.any() or missing:
                self._audit_failed(int(stray.sum()), missing)
                runs = self.runs = None
                return
        for i in np.flatnonzero(stray):
            runs.leave(ids[i])
        for i in np.flatnonzero(decodes & ~going_on):
            if ids[i] not in self._gone:
                runs.join(ids[i], int(slots[i]), float(nxt[i]))
        if missing:  # not scheduled (preempted, or no room): split explicitly when back
            here = set(ids)
            for req_id in [r for r in members if r not in here]:
                runs.leave(req_id)

    def _audit_failed(self, stray: int, missing: int) -> None:
        self.audit_failures += 1
        if self.runs is not None:
            self.runs.leave_all()
        logger.warning(
            "vllm_piep: the scheduler's lists passed the cheap checks for a step of decode runs "
            "that an explicit check disagrees with (%d requests not one token on, %d not "
            "scheduled); every step is split explicitly from now on "
            "(piep_engine_audit_failures_total)", stray, missing)

    def _runs_failed(self, runs: DecodeRuns, regular: bool) -> None:
        """A step that could not be predicted: its members' runs get nothing for it and are
        marked incomplete (`_step_failed` marked the explicit ones)."""
        if runs.members:
            slots = np.fromiter(runs.members.values(), np.intp, len(runs.members))
            self.table.rows[slots, _INCOMPLETE] = 1.0
        runs.leave_all()

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
        increment, warmup_j = self._take_warmup(step.req_ids, float(step.sched[1].sum()),
                                                increment, step_ns / 1e9)
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
        """The step's requests' slots (`_slots_for`)."""
        return self._slots_for(step.req_ids, step.new_prompts)

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
        """These requests' running totals as one block (`vllm_piep.runtime.record`), and
        remember that an output carried them."""
        table = self.table
        get = table.slots.get
        slots = np.fromiter((get(r, ZERO_SLOT) for r in req_ids), np.intp, len(req_ids))
        runs = self.runs
        if runs is not None and runs.members:
            runs.fold_ids(req_ids)
        block = table.rows[slots]
        table.rows[slots, SENT] = block[:, _PREFILL] + block[:, _DECODE]
        table.rows[ZERO_SLOT] = 0.0
        return encode_rows(block)

    def record(self, req_id: str) -> WireRecord:
        """A request's running total, decoded (for tests and tools; nothing is marked sent)."""
        if self.runs is not None:
            self.runs.fold_ids([req_id])
        slot = self.table.slots.get(req_id, ZERO_SLOT)
        return WireRecord.from_wire(self.header(counts=False),
                                    encode_rows(self.table.rows[slot:slot + 1]))

    def mark_incomplete(self, req_ids: Iterable[str]) -> None:
        """A step of these requests could not be accounted: their energy will be omitted."""
        for req_id in req_ids:
            slot = self._slot(req_id)  # may grow (replace) the array: index it afterwards
            self.table.rows[slot, _INCOMPLETE] = 1.0

    @property
    def tracked_requests(self) -> int:
        return len(self.table)

def _explicit_part(step: RawStep | ScheduledStep, positions: list[int] | None
                   ) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """(ids, `sched` [4, m], prompt lengths given outright or None) of the requests a step
    splits explicitly: those at `positions` of a `RawStep`, or every request (None)."""
    if type(step) is not RawStep:
        made = step if isinstance(step, ScheduledStep) else ScheduledStep.of_raw(step)
        return made.req_ids, made.sched, None if made.prompt is None else made.prompt[0]
    raw: RawStep = step
    if positions is None:
        ids = raw.req_ids
        start = raw.start[0] + raw.start[1]
        outs = raw.outs[0] + raw.outs[1]
    elif not positions:
        return [], np.empty((4, 0)), None
    else:
        nc = len(raw.start[0])
        ids = [raw.req_ids[i] for i in positions]
        start = [raw.start[0][i] if i < nc else raw.start[1][i - nc] for i in positions]
        outs = [raw.outs[0][i] if i < nc else raw.outs[1][i - nc] for i in positions]
    m = len(ids)
    sched = np.empty((4, m))
    sched[0] = start
    sched[1] = np.fromiter(map(raw.scheduled.__getitem__, ids), np.float64, m)
    sched[2] = outs
    spec = raw.spec_tokens
    sched[3] = [1 + len(spec.get(r, ())) for r in ids] if spec else 1.0
    return ids, sched, None
