"""Engine-side energy accounting: predict each step, split it among the step's requests, keep
each request's running total, and encode them for the trip to the API server. No vLLM imports:
the engine-core patches feed it plain numbers, as the scheduler holds them.

The engine loop does none of this: it queues the calls (`deferred.py`), which run off the loop,
in order. Each step is accounted at its own update (`on_step_done`), so a request's total
through its last step is known when its final output goes out: nothing waits for the plugin.

The split is the predictor's rule (`predict/split_rule.py`): linear in each request's features
given the step, run as Python generated from the predictor's constants
(`predict/split_code.py`, checked against the rule when the predictor loads). Requests in a run
of one-token decode steps get theirs in closed form (`decode_runs.py`: O(1) per step, whatever
the batch); the rest of a step (new, prefilling, resumed, speculative, late requests) is split
explicitly, O(their count). Cheap checks on the scheduler's lists say whether a step's cached
requests are the runs' members, each one token on (`DecodeRuns.regular`); a step that breaks
the pattern is split explicitly for every request, and every few steps some members are
checked one by one (`DecodeRuns.audit`: a disagreement is counted, logged once, and ends the
closed form). Members with speculative tokens stay in their runs: their extra tokens are split
explicitly. A predictor without a split rule (`PIEP_PREDICTOR`), or whose generated split disagrees
with its rule, predicts each step whole (`_predict_whole`). No numpy call runs per step or per
output on the split rule's path: numpy's cost per call exceeds the arithmetic of a step's few
numbers.

The accountant coordinates parts that own their state, one module each: the steps in flight and
their times (`step_table.py`), the request table, the only writer of rows and outcome totals
(`request_table.py`), the decode runs, the release book (`releases.py`), warm-up
(`warmup_shares.py`), the settler chosen per mode, prediction or measured
(`measured_settlement.py`), and what went out to the API servers (`engine_counts.py`). An
engine that sends outputs (`sparse`) gives rows only to the outputs that finish a request and
to every output of a request with stop strings (`dense_ids`).
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from operator import add
from typing import Any

import numpy as np
from msgspec.structs import replace

from vllm_piep.meters.split import IntervalSplitter
from vllm_piep.model.components import STATIC
from vllm_piep.model.flops import StepBatch
from vllm_piep.once import OnceLogger, logger
from vllm_piep.predict.attribution import prefill_fraction, split_step
from vllm_piep.predict.base import LinearSplit, Predictor, StepInput
from vllm_piep.predict.split_code import PythonSplit, base, make_python_split
from vllm_piep.predict.stepgraph import N_OUT
from vllm_piep.runtime.engine_core.decode_runs import DecodeRuns, Disagreement, Speculative
from vllm_piep.runtime.engine_core.deferred import DeferredCalls
from vllm_piep.runtime.engine_core.engine_counts import (
    Counts,
    Reports,
    step_header,
    with_counts,
)
from vllm_piep.runtime.engine_core.measured_settlement import (
    MeasuredSettler,
    PredictedSettler,
    StepShares,
)
from vllm_piep.runtime.engine_core.metered_runs import MeteredRuns
from vllm_piep.runtime.engine_core.releases import ReleaseBook
from vllm_piep.runtime.engine_core.request_table import ALL_OUTPUTS, FIRST, RequestTable
from vllm_piep.runtime.engine_core.scheduled import RawStep, ScheduledStep, step_batch
from vllm_piep.runtime.engine_core.step_table import Step, StepTable
from vllm_piep.runtime.engine_core.warmup_shares import WarmupShares
from vllm_piep.runtime.record import StepHeader, WireRecord, encode_rows

__all__ = ["EngineAccountant"]


class EngineAccountant:
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
        self._run_step: Callable | None = None  # a step graph's whole step, where it has one
        # The predictor's split rule as Python, where it has one, and the row columns of its
        # shares (prefill, decode, its live components).
        self._split: PythonSplit | None = None
        self._columns: tuple[int, ...] = ALL_OUTPUTS
        self.engine_id = engine_id
        # The accountant's clock (the loop reads it when it queues a step's calls): a plain
        # attribute, one lookup fewer than a method on the loop's critical path.
        self.now_ns = clock_ns
        self.steps_table = StepTable()
        self.table = RequestTable()
        self.book = ReleaseBook()
        self.warmup = WarmupShares(self.table)
        self.settler: PredictedSettler | MeasuredSettler = PredictedSettler(self.table)
        self.reports = Reports(clock_ns)
        self.runs: DecodeRuns | None = None  # the closed form, once the predictor has a rule
        self.errors = 0  # steps that could not be accounted (piep_predictor_errors_total)
        self.regular_steps = 0  # steps whose cached requests all went on in their runs
        self.audits = 0  # regular steps offered to the audit (`DecodeRuns.audit`)
        self.audit_failures = 0  # of them, disagreements (the closed form then ends)
        self._once = OnceLogger()
        # Serialises the engine loop's calls, the meter thread and the idle flush.
        self.lock = threading.RLock()
        self.waiting: set[str] = set()  # measured mode: finished requests whose output waits
        self.engine_meter: Any = None  # measured.EngineMeter, once started
        self.meter_note: str | None = None  # why not measured mode, where a meter was to serve
        self.meter_shared = 0  # others' processes on the metered GPUs (-1: cannot tell)
        # The engine loop's calls, run off the loop in order (`deferred.py`); run them with
        # `lock` held before reading the state they change.
        self.deferred = DeferredCalls(self._deferred_failed)
        self.loop_steps = 0  # steps updated (every `_SWEEP_EVERY`, a sweep is due: `LoopHandle`)
        # Requests released with their final output since the last scheduled step was read:
        # the finished ids that step names (`release_finished`) and that are not these were
        # aborted from outside.
        self.finished: set[str] = set()
        # An engine that sends outputs: only the outputs that finish a request, and those of
        # requests with stop strings (`dense_ids`: the API server may finish them), carry rows.
        self.sparse = False
        self.dense_ids: set[str] = set()
        # What the header without counts was made of, the header, and encoded (`_plain`).
        self._plain_header: tuple[Any, StepHeader, bytes] | None = None
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
                    split = make_python_split(predictor.split_rule())
                    if split is not None:
                        self._split = split
                        self._columns = (0, 1, *[FIRST + c for c in split.live])
                        self.runs = DecodeRuns(self.table, self._columns[2:])
                self._predictor = predictor
            except Exception as exc:  # boundary: a bad predictor must not stop serving
                self._predictor_failed = True  # each step then fails (`_step_failed` counts)
                self._once.warn("loading the energy predictor", exc,
                                "responses will carry no usage.energy")
        return self._predictor

    # -- steps --------------------------------------------------------------------------------
    def on_schedule(self, key: int, step: Step | Callable[[], Step] | list[str],
                    batch: StepBatch | None = None, at_ns: int | None = None) -> None:
        """A step was scheduled (at `at_ns`, else now); its work is known now, its duration
        when it is done. A `RawStep` or `ScheduledStep` (or what makes it, called when the
        step is accounted), or request ids and their `StepBatch`."""
        if isinstance(step, list):
            assert batch is not None, "request ids need their StepBatch"
            step = ScheduledStep.of_batch(step, batch)
        self.steps_table.scheduled(key, step, self.now_ns() if at_ns is None else at_ns)

    def on_step_done(self, key: int, worker_step_ns: int | None = None,
                     timer: str | None = None, at_ns: int | None = None) -> None:
        """The step's model output arrived (at `at_ns`, else now): it is predicted and its
        shares go to the settler (`StepTable.done` says which time the step takes)."""
        now = self.now_ns() if at_ns is None else at_ns
        done = self.steps_table.done(key, worker_step_ns, timer, now)
        if done is None:
            return
        entry, step_ns = done
        try:
            step = entry.step() if callable(entry.step) else entry.step
        except Exception as exc:  # boundary: one bad step must not lose the others
            self._deferred_failed("reading a step", exc)
            return
        # Reading `predictor` loads it at the first step, and the load makes `_split` where the
        # split rule applies: `_split` is read again after that first read.
        split = self._split
        if split is None and self.predictor is not None:
            split = self._split
        if split is not None:
            self._account(step, step_ns, now)
        else:
            self._predict_whole(step, step_ns, now)
        self.book.expire(self.steps_table.steps)

    def _account(self, step: Step, step_ns: int, now: int) -> None:
        """One step by the split rule (module docstring)."""
        split = self._split
        assert split is not None
        runs = self.runs
        if runs is not None and (type(step) is not RawStep or not self.warmup.detector.ready):
            runs = None  # the closed form waits for warm-up's judgement
        explicit: list[int] | None = None
        speculative: Speculative | None = None
        if runs is not None:
            found = runs.regular(step)  # type: ignore[arg-type]
            if found is not None:
                explicit, speculative = found
                self.audits += 1
                stray = runs.audit(step)  # type: ignore[arg-type]
                if stray:
                    self._audit_failed(stray)
                    runs = explicit = speculative = None
        regular = explicit is not None
        if regular and not explicit and not speculative:
            if not len(runs):  # type: ignore[arg-type]
                return  # a step of no request (vLLM schedules none such): nothing to split
            self.regular_steps += 1
            if self._decode_step(runs, step_ns / 1e9, step_ns, now):  # type: ignore[arg-type]
                return
        else:
            self.regular_steps += regular
        seconds = step_ns / 1e9
        ids, starts, ns, outs, draws, given = _explicit_part(step, explicit)
        try:
            slots = self._slots_for(ids, step.new_prompts)
        except Exception as exc:  # boundary
            self._deferred_failed("mapping a step's requests", exc)
            return
        prompts = given if given is not None else [self.table.prompt[s] for s in slots]
        d, e = (len(runs), runs.expected_context()) if regular else (0, 0)  # type: ignore[arg-type]
        extras = speculative.extras if speculative else []
        tokens = sum(ns) + d + sum(x[0] for x in extras)
        fraction = self.warmup.fraction(tokens, seconds) if runs is not None else 0.0
        try:
            bases = list(map(base, starts, ns, outs, draws, prompts))
            shares, terms, _, joules, static_j = split.explicit(bases, extras, d, e, seconds,
                                                                1.0 - fraction)
            if not math.isfinite(joules):  # non-negative parts: finite iff every part is
                raise ValueError(f"non-finite step energy {joules}")
        except Exception as exc:  # boundary
            self._step_failed(exc, ids, slots)
            if runs is not None:
                self._runs_failed(runs)
            return
        if speculative:  # their extra shares go to the members' rows too
            ids = ids + speculative.ids
            slots = slots + speculative.slots
        warmup_j = static_j * fraction
        if runs is None:
            shares, warmup_j = self.warmup.take(ids, tokens, shares, self._columns, seconds,
                                                self.book.gone, not self.settler.measured)
        self.settler.add(StepShares(self.steps_table.steps, ids, slots, shares, self._columns,
                                    joules, static_j, warmup_j, now - step_ns, now,
                                    runs is not None))
        if runs is not None:
            runs.push(terms if regular else None)
            gone = self.book.gone
            if regular:  # the explicit requests that decode from the next step join runs
                for i, features in enumerate(bases):
                    if features[3] > 0.0 and ids[i] not in gone:
                        # From its context without its drafts: those it accepted move it on
                        # next step (`DecodeRuns.regular`).
                        runs.join(ids[i], slots[i], starts[i] + ns[i] - (draws[i] - 1))
                        if draws[i] > 1:
                            runs.jumps.append(ids[i])
            else:
                runs.follow(ids, list(map(add, starts, ns)),
                            [b[3] > 0.0 and dr == 1 for b, dr in zip(bases, draws, strict=True)],
                            [n == 1 for n in ns], starts, slots, False, gone)
        elif self.runs is not None and self.runs.members:
            self.runs.leave_all()  # a step not read off vLLM's lists: explicit from here
        gone = self.book.gone
        if gone and not gone.keys().isdisjoint(ids):
            self._forget_late(ids)

    def _decode_step(self, runs: DecodeRuns, seconds: float, step_ns: int, now: int) -> bool:
        """A step of the runs' members alone (`_account`'s common case), in a few operations:
        False where the split cannot fold it (contexts all 0: then `_account` goes on)."""
        d = len(runs.members)
        e = runs.expected_context()
        if e <= 0:
            return False
        fraction = self.warmup.fraction(d, seconds)
        try:
            terms, _, joules, static_j = self._split.decode(  # type: ignore[union-attr]
                d, e, seconds, 1.0 - fraction)
            if not math.isfinite(joules):
                raise ValueError(f"non-finite step energy {joules}")
        except Exception as exc:  # boundary
            self._step_failed(exc, [], [])
            self._runs_failed(runs)
            return True
        runs.push(terms)
        self.settler.add_runs_step(self.steps_table.steps, joules, static_j,
                                   static_j * fraction, now - step_ns, now)
        return True

    def _audit_failed(self, found: Disagreement) -> None:
        self.audit_failures += 1
        if self.runs is not None:
            self.runs.leave_all()
            self.runs = None
        logger.warning(
            "vllm_piep: the scheduler's lists passed the cheap checks for a step of decode runs "
            "that a check one by one disagrees with (%d requests not one token on); every step "
            "is split explicitly from now on (piep_engine_audit_failures_total)", found.stray)

    def _runs_failed(self, runs: DecodeRuns) -> None:
        """A step that could not be predicted: its members' runs get nothing for it and are
        marked incomplete (`_step_failed` marked the explicit ones)."""
        if runs.members:
            self.table.mark_incomplete(runs.members.values())
        runs.leave_all()

    def _predict_whole(self, step: Step, step_ns: int, now: int) -> None:
        """One step predicted whole: through the predictor's step graph (the reference), or
        its `predict_step`, split here."""
        made = step if isinstance(step, ScheduledStep) else ScheduledStep.of_raw(step)
        try:
            slots = self._slots_for(made.req_ids, made.new_prompts)
        except Exception as exc:  # boundary
            self._deferred_failed("mapping a step's requests", exc)
            return
        predictor = self.predictor
        try:
            if predictor is None:
                raise RuntimeError("no predictor")
            prompt = made.prompt if made.prompt is not None else np.array(
                [[self.table.prompt[s] for s in slots]], dtype=np.float64)
            if self._run_step is not None:
                requests, per_component = self._run_step(made.sched, prompt, step_ns / 1e9)
                shares = requests.T
            else:
                shares, per_component = _split_elsewhere(predictor, made, prompt, step_ns)
            joules = float(per_component.sum())  # non-negative parts: finite iff every part is
            if not math.isfinite(joules):
                raise ValueError(f"non-finite step energy {per_component}")
        except Exception as exc:  # boundary
            self._step_failed(exc, made.req_ids, slots)
            return
        taken, warmup_j = self.warmup.take(made.req_ids, float(made.sched[1].sum()),
                                           list(map(tuple, shares.tolist())), ALL_OUTPUTS,
                                           step_ns / 1e9, self.book.gone,
                                           not self.settler.measured)
        self.settler.add(StepShares(self.steps_table.steps, made.req_ids, slots, taken,
                                    ALL_OUTPUTS, joules, float(per_component[STATIC]),
                                    warmup_j, now - step_ns, now, False))
        if self.book.gone:
            self._forget_late(made.req_ids)

    def _step_failed(self, exc: BaseException, req_ids: list[str], slots: list[int]) -> None:
        """A step that could not be predicted: its requests' energy is incomplete (no
        predictor: said once when loading it)."""
        self.errors += 1  # piep_predictor_errors_total: steps whose prediction failed
        if self._predictor is not None:
            self._once.warn("predicting a step's energy", exc,
                            "the requests in that step get no usage.energy")
        self.table.mark_incomplete(slots)
        if self.book.gone:
            self._forget_late(req_ids)

    def _slots_for(self, ids: list[str], new_prompts: dict[str, int]) -> list[int]:
        """The requests' slots (new ones get theirs, with their prompt lengths); a released
        request's late step takes a new slot with its prompt length (its share then goes to
        an outcome)."""
        table = self.table
        known = table.slots
        get = known.get
        slots = [get(r, -1) for r in ids]
        if -1 in slots:  # new requests (or a released one's late step)
            slots = [s if s >= 0 else self._slot(r) for r, s in zip(ids, slots, strict=True)]
        if new_prompts:
            prompt = table.prompt
            for req_id, n in new_prompts.items():
                prompt[known[req_id]] = n
        return slots

    def _slot(self, req_id: str) -> int:
        table = self.table
        known = req_id in table.slots
        slot = table.slot(req_id)
        if not known:
            prompt = self.book.prompt_of(req_id)
            if prompt is not None:  # a late step of a released request: its prompt counts
                table.prompt[slot] = prompt
        return slot

    # -- rows on outputs ----------------------------------------------------------------------
    def encode(self, req_ids: list[str]) -> bytes:
        """These requests' running totals as one block (`vllm_piep.runtime.record`), and
        remember that an output carried them."""
        runs = self.runs
        if runs is not None and runs.members:
            runs.fold_ids(req_ids)
        return self.table.encode(req_ids)

    def record(self, req_id: str) -> WireRecord:
        """A request's running total, decoded (for tests and tools; nothing is marked sent)."""
        if self.runs is not None:
            self.runs.fold_ids([req_id])
        return WireRecord.from_wire(self.header(counts=False),
                                    encode_rows(array("d", self.table.row(req_id))))

    def mark_incomplete(self, req_ids: Iterable[str]) -> None:
        """A step of these requests could not be accounted: their energy will be omitted."""
        self.table.mark_incomplete([self._slot(req_id) for req_id in req_ids])

    @property
    def tracked_requests(self) -> int:
        return len(self.table)

    # -- releases -----------------------------------------------------------------------------
    def release(self, req_id: str, aborted: bool = True, final: bool = False) -> None:
        """The engine is done with the request (`aborted`: from outside, with no final
        output, possibly while a step of it runs; else it finished with this output). Energy
        no output carried is counted as unsent (aborted) or after-finish (finished), so the
        engine's totals still add up. `final`: a released request's late step was accounted."""
        if not aborted and not final:
            self.finished.add(req_id)
        # Sparse mode: no output carried any of a request aborted from outside unless every
        # output carried its row; what it cost is the client's abort, not an unsent remainder.
        no_output = self.sparse and not final and req_id not in self.dense_ids
        self.dense_ids.discard(req_id)
        if self.runs is not None:
            self.runs.leave(req_id)
        prompt = self.table.close(req_id, aborted, no_output)
        if self.settler.measured:  # its steps waiting for the meter: unsent or not
            self.settler.note_release(req_id, aborted)  # type: ignore[union-attr]
        if aborted or len(self.steps_table):  # a step already scheduled may still name it
            self.book.remember(req_id, aborted, prompt, self.steps_table.steps)

    def release_finished(self, finished_ids: Iterable[str]) -> None:
        """vLLM's requests finished since the step before this one was scheduled
        (`SchedulerOutput.finished_req_ids`: every reason, aborts included). Those whose
        final output did not release them (`finished`), nor wait for the meter (`waiting`),
        were aborted from outside (a client gone, stop strings the API server found): no
        output will carry them."""
        done, self.finished = self.finished, set()
        waiting = self.waiting
        for req_id in finished_ids:
            if req_id not in done and req_id not in waiting:
                self.release(req_id)

    def sweep(self, live: Iterable[str], every: int = 1) -> None:
        """Release requests the engine no longer has (aborted without a final output); at most
        once per `every` steps."""
        if not self.book.sweep_due(self.steps_table.steps_done, every):
            return
        live_set = set(live) | self.waiting
        for req_id in [r for r in self.table.slots if r not in live_set]:
            self.release(req_id)

    def release_missing(self, missing: Iterable[str]) -> None:
        """Requests tracked when the engine loop looked and gone from its scheduler then
        (aborted without a final output): released where still tracked and no output waits
        for them (`waiting`). The loop finds them as a difference of the two key sets, at C
        speed and O(tracked), whatever the scheduler's queue holds."""
        slots, waiting = self.table.slots, self.waiting
        for req_id in missing:
            if req_id in slots and req_id not in waiting:
                self.release(req_id)

    def _forget_late(self, req_ids: list[str]) -> None:
        """Requests released while a step of theirs ran: no output will carry this step's
        share. An aborted request's share is unsent energy; a finished one's (async
        scheduling had already put it into this step) is after-finish energy. Neither may stay
        tracked."""
        for req_id, aborted in self.book.late(req_ids):
            self.release(req_id, aborted=aborted, final=True)

    # -- measured mode ------------------------------------------------------------------------
    def measure_with(self, splitter: IntervalSplitter, meter_name: str, source: str) -> None:
        """From now on each step waits for the meter (`settle`)."""
        with self.lock:
            settler = MeasuredSettler(self.table, splitter, meter_name, source)
            if self.runs is not None:  # the steps before: predicted, folded into the rows
                self.runs.leave_all()
                self.runs = settler.runs = MeteredRuns(self.table, self.runs.columns,
                                                       settler.released)
            self.settler = settler

    @property
    def splitter(self) -> IntervalSplitter | None:
        return self.settler.splitter if self.settler.measured else None  # type: ignore[union-attr]

    def steps_in_flight(self) -> int:
        """Steps scheduled whose output has not come back."""
        return len(self.steps_table)

    def known_until_ns(self) -> int:
        """Up to when every step's time is known (`StepTable.known_until_ns`)."""
        return self.steps_table.known_until_ns(self.now_ns())

    def settle(self, fallback_until_ns: int | None = None) -> int:
        """Measured mode: settle the steps the meter's readings cover (or, with
        `fallback_until_ns`, the steps ended by then, by the fit); how many. Lock held."""
        settler = self.settler
        if not settler.measured:
            return 0
        if fallback_until_ns is None:
            return settler.settle(self.known_until_ns())  # type: ignore[union-attr]
        return settler.settle(fallback_until_ns, fallback=True)  # type: ignore[union-attr]

    def unsettled(self, req_id: str) -> bool:
        """Whether a step of the request still waits for the meter."""
        settler = self.settler
        if not settler.measured:
            return False
        slot = self.table.slots.get(req_id)
        runs = self.runs
        return settler.unsettled(slot) or (  # type: ignore[union-attr]
            isinstance(runs, MeteredRuns) and runs.unsettled(req_id, slot))

    # -- counts and header --------------------------------------------------------------------
    def counts(self) -> Counts:
        """The engine's counts, cumulative."""
        o, s = self.table.outcomes, self.settler
        measured = s.measured
        return Counts(o.step_joules, self.errors, o.unsent, o.aborted, o.after_finish,
                      o.warmup, s.predicted_joules if measured else 0.0,  # type: ignore[union-attr]
                      s.idle_joules if measured else 0.0,  # type: ignore[union-attr]
                      s.fitted_joules if measured else 0.0,  # type: ignore[union-attr]
                      s.fallback_steps if measured else 0,  # type: ignore[union-attr]
                      s.estimated_joules if measured else 0.0,  # type: ignore[union-attr]
                      self.audit_failures, self.steps_table.zero_time_steps,
                      tuple(self.steps_table.by_timer.values()))

    def unreported(self) -> bool:
        """Whether some count has not gone out yet (the idle flush asks)."""
        return self.reports.unreported(self.counts())

    def counts_due(self) -> bool:
        return self.reports.due()

    def header_bytes(self, counts: bool) -> bytes:
        """`header(counts)`, encoded; the header without counts is encoded once for as long as
        what it says stays the same (in prediction mode, the engine's whole life)."""
        if counts:
            return self.header(counts=True).encode()
        return self._plain()[2]

    def header(self, counts: bool = True) -> StepHeader:
        """Who predicted; with `counts`, the engine's counts since they last went out (each
        increment goes out once: the caller sends this header to one API server), else
        zeros."""
        plain = self._plain()[1]
        if not counts:
            return plain
        header = with_counts(plain, self.reports.take(self.counts()), len(self.table))
        ids, rows = self.table.take_aborted()
        if ids:
            header = replace(header, aborted_ids=ids, aborted_rows=rows)
        return header

    def _plain(self) -> tuple[Any, StepHeader, bytes]:
        """The header without counts, and encoded, made again only when what it says changed
        (the predictor, the mode, the meter's note or ratios)."""
        key = (self._predictor, self.settler, self.meter_note, self.meter_shared,
               self.settler.splitter.ratios() if self.settler.measured else None)  # type: ignore[union-attr]
        plain = self._plain_header
        if plain is None or plain[0] != key:
            header = step_header(Counts(), False, 0, self.engine_id, self._predictor,
                                 self.settler, self.meter_note, self.meter_shared)
            plain = self._plain_header = (key, header, header.encode())
        return plain

    # -- totals, as the header counts them ----------------------------------------------------
    @property
    def total_joules(self) -> float:
        return self.table.outcomes.step_joules

    @property
    def unsent_joules(self) -> float:
        return self.table.outcomes.unsent

    @property
    def aborted_joules(self) -> float:
        return self.table.outcomes.aborted

    @property
    def after_finish_joules(self) -> float:
        return self.table.outcomes.after_finish

    @property
    def warmup_joules(self) -> float:
        return self.table.outcomes.warmup

    @property
    def steps(self) -> int:
        return self.steps_table.steps

    @property
    def steps_done(self) -> int:
        return self.steps_table.steps_done


def _split_elsewhere(predictor: Predictor, step: ScheduledStep, prompt: np.ndarray,
                     step_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """A predictor without a step graph: its `predict_step`, split here."""
    batch = step_batch(step.sched, prompt[0])
    energy = predictor.predict_step(StepInput(batch=batch, step_seconds=step_ns / 1e9))
    per_request = split_step(energy)
    increment = np.empty((len(batch), N_OUT))
    increment[:, 2:] = per_request
    total = per_request.sum(axis=1)
    increment[:, 0] = total * prefill_fraction(batch)
    increment[:, 1] = total - increment[:, 0]
    return increment, np.asarray(energy.joules, dtype=np.float64)


def _explicit_part(step: Step, positions: list[int] | None
                   ) -> tuple[list[str], list[int], list[int], list[int], list[int],
                              list[float] | None]:
    """(ids, tokens computed before the step, tokens scheduled, outputs so far, draws, prompt
    lengths given outright or None) of the requests a step splits explicitly: those at
    `positions` of a `RawStep`, or every request (None)."""
    if type(step) is not RawStep:
        made = step if isinstance(step, ScheduledStep) else ScheduledStep.of_raw(step)
        start, n, outs, draws = made.sched.tolist()
        return (made.req_ids, start, n, outs, draws,
                None if made.prompt is None else made.prompt[0].tolist())
    raw: RawStep = step
    nc = len(raw.start[0])
    if positions is None:
        ids = raw.req_ids
        start = raw.start[0] + raw.start[1]
        outs = raw.outs[0] + raw.outs[1]
    elif not positions:
        return [], [], [], [], [], None
    elif positions[0] == nc:  # the new requests alone (`DecodeRuns.regular` lists them last)
        ids = raw.req_ids[nc:]
        start, outs = raw.start[1], raw.outs[1]
    else:
        ids = [raw.req_ids[i] for i in positions]
        start = [raw.start[0][i] if i < nc else raw.start[1][i - nc] for i in positions]
        outs = [raw.outs[0][i] if i < nc else raw.outs[1][i - nc] for i in positions]
    spec = raw.spec_tokens
    draws = [1 + len(spec.get(r, ())) for r in ids] if spec else [1] * len(ids)
    return ids, start, list(map(raw.scheduled.__getitem__, ids)), outs, draws, None
