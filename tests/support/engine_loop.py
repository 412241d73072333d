"""A played engine loop for tests and benchmarks: seeded scheduler states step after step, as
vLLM's scheduler hands them to the plugin's wrappers (the attributes they read), and the real
vLLM outputs of each step."""

from __future__ import annotations

import copy
import ctypes
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np

from vllm_piep.runtime.engine_core import (
    output_records,
    patch_encode_into,
    patch_get_grammar_bitmask,
    patch_schedule,
    patch_update_from_output,
    scheduler_accountant,
)
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.record import PICK_DTYPE, PICKS_KEY, ROWS_KEY
from vllm_piep.runtime.worker.step import STEP_TIME_ATTR
from vllm_piep.runtime.worker.steptime import HOST_TIMER, KnownStepTime

CONTEXT, PROMPT = (90, 110), 32
_libc = ctypes.CDLL(None)
_sched_yield = _libc.sched_yield


def spin_wait(seconds: float) -> None:
    """Wait as a CUDA host thread that yields waits on the device (`cudaDeviceScheduleYield`):
    busy, the GIL free (each `sched_yield` call releases it), the core kept awake, a system call
    per turn. `poll_wait` spins without one, as CUDA's default wait does with fewer contexts
    than cores."""
    end = time.perf_counter() + seconds
    clock, yield_ = time.perf_counter, _sched_yield
    while clock() < end:
        yield_()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_clock_gettime = _libc.clock_gettime
_CLOCK_MONOTONIC = 1


def poll_wait(seconds: float) -> None:
    """Wait as a CUDA host thread spins on the device's completion flag
    (`cudaDeviceScheduleSpin`): busy, polling memory without a system call, the GIL free
    between polls (each poll is a foreign call: `clock_gettime`, which the vDSO answers in
    user space)."""
    end = time.perf_counter() + seconds
    clock, poll = time.perf_counter, _clock_gettime
    spec = ctypes.byref(_Timespec())
    while clock() < end:
        poll(_CLOCK_MONOTONIC, spec)


class Workload:
    """Seeded scheduler states, step after step: the same sequence for every placement."""

    def __init__(self, n: int, seed: int, finish_p: float = 0.01, abort_p: float = 0.0025,
                 stop_p: float = 0.0, rich: Rich | None = None) -> None:
        self.finish_p, self.abort_p = finish_p, abort_p
        self.rng = random.Random(seed)
        # What else the scheduler does (`Rich`), drawn apart: without it, the same states.
        self.rich, self.xrng = rich, random.Random(seed + 2)
        # New requests with stop strings (the API server may finish them), drawn apart so that
        # the states are the same for every `stop_p`.
        self.stop_p, self.stop_rng = stop_p, random.Random(seed + 1)
        self.with_stop: set[str] = set()
        self.next_id = 0
        self.live: dict[str, list[int]] = {}  # id -> [computed, outputs, prompt]
        self.requests: dict[str, Any] = {}
        for _ in range(n):
            rid = self._new()
            computed = self.rng.randint(*CONTEXT)
            self.live[rid] = [computed, computed - PROMPT + 1, PROMPT, 0]
        self.with_stop.clear()  # running before the plugin saw them: it never reads theirs
        self.fresh: list[str] = []

    def _new(self) -> str:
        rid = f"req-{self.next_id}"
        self.next_id += 1
        stop = ["\n\n"] if self.stop_rng.random() < self.stop_p else []
        if stop:
            self.with_stop.add(rid)
        prompt = PROMPT if self.rich is None else self.xrng.randint(*self.rich.prompt)
        self.requests[rid] = SimpleNamespace(num_prompt_tokens=prompt, num_output_tokens=0,
                                             request_id=rid,
                                             sampling_params=SimpleNamespace(stop=stop))
        return rid

    def step(self) -> tuple[Any, list[str], list[str], list[str]]:
        """(the scheduler output, the requests with an output of this step, those that end
        with this step, those aborted from outside after it). A request's state: [tokens
        computed, outputs so far, prompt length, steps left preempted]; it schedules its known
        tokens not computed yet (prompt and outputs; `Rich.chunk` at most), and samples when
        the step reaches their end."""
        rich, x = self.rich, self.xrng
        chunk = rich.chunk if rich is not None else 1 << 30
        fresh = set(self.fresh)
        cached = []
        for r, state in self.live.items():
            if r in fresh:
                continue
            if state[3] > 0:  # preempted: not scheduled until it resumes
                state[3] -= 1
                continue
            cached.append(r)
        scheduled: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        for r in cached:
            computed, outs, prompt, _ = self.live[r]
            scheduled[r] = min(prompt + outs - computed, chunk)
            if rich is not None and scheduled[r] == 1 and x.random() < rich.spec_p:
                spec[r] = [7] * x.randint(1, 3)
                scheduled[r] += len(spec[r])
        new = []
        for r in self.fresh:
            prompt = self.live[r][2]
            hit = 0
            if rich is not None and x.random() < rich.prefix_hit_p:
                hit = 16 * x.randint(0, (prompt - 1) // 16)
            self.live[r][0] = hit
            new.append(SimpleNamespace(req_id=r, num_computed_tokens=hit,
                                       prompt_token_ids=[7] * prompt, prompt_embeds=None,
                                       sampling_params=self.requests[r].sampling_params))
            scheduled[r] = min(prompt - hit, chunk)
        out = SimpleNamespace(
            total_num_scheduled_tokens=sum(scheduled.values()),
            num_scheduled_tokens=scheduled, scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=cached, num_computed_tokens=[self.live[r][0] for r in cached],
                num_output_tokens=[self.live[r][1] for r in cached]),
            scheduled_spec_decode_tokens=spec,
            finished_req_ids=set())  # the loop sets what finished before it is scheduled
        sampled = []
        for r, n in scheduled.items():
            state = self.live[r]
            reaches = state[0] + n >= state[2] + state[1]
            state[0] += n
            if reaches:
                taken = 1
                if r in spec:  # some draft tokens accepted, the rest rolled back
                    accepted = x.randint(0, len(spec[r]))
                    state[0] -= len(spec[r]) - accepted
                    taken += accepted
                state[1] += taken
                sampled.append(r)
        self.fresh = []
        done = set(sampled)
        ended = [r for r in self.live if r in done and self.rng.random() < self.finish_p]
        aborted = [r for r in self.live if r not in ended and self.rng.random() < self.abort_p]
        for r in ended + aborted:
            del self.live[r]
        if rich is not None:
            for r in sampled:
                if r in self.live and x.random() < rich.preempt_p:
                    self.live[r][0] = 0  # its KV cache freed: recomputed when it resumes
                    self.live[r][3] = x.randint(1, 3)
        for _ in range(len(ended) + len(aborted)):
            rid = self._new()
            self.live[rid] = [0, 0, self.requests[rid].num_prompt_tokens, 0]
            self.fresh.append(rid)
        return out, sampled, ended, aborted


class Rich(NamedTuple):
    """What a `Workload`'s scheduler does besides one-token decode steps and whole prompts."""

    prompt: tuple[int, int] = (8, 300)  # prompt lengths drawn from this range
    chunk: int = 64  # tokens a request is scheduled per step at most (chunked prefill)
    prefix_hit_p: float = 0.3  # a new request's prompt starts in the prefix cache
    preempt_p: float = 0.02  # a request is preempted after a step (recomputed on resuming)
    spec_p: float = 0.2  # a decoding request's step has speculative tokens


BLOCK, SETTLE = 50, 5  # steps a lane plays in its turn; the first of a turn are not counted


def in_turns(steps: int, lanes: dict[bool, Iterator[Any]]) -> dict[bool, list[Any]]:
    """Two lanes of the same engine steps, with the plugin (True) and without (False), played in
    turns of `BLOCK` steps (the order of the pair switching every turn): what each yielded per
    step, but for the first `SETTLE` of each turn. Each lane runs as an engine would, the same
    calls step after step; the turns spread this machine's drift over both alike."""
    got: dict[bool, list[Any]] = {True: [], False: []}
    for turn, start in enumerate(range(0, steps, BLOCK)):
        for plugin in ((True, False) if turn % 2 == 0 else (False, True)):
            turn_steps = range(start, min(steps, start + BLOCK))
            for k, value in zip(turn_steps, lanes[plugin], strict=False):
                if k - start >= SETTLE:
                    got[plugin].append(value)
    return got


def outputs_of(req_ids: list[str], ended: list[str]) -> dict[int, Any]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    done = set(ended)
    return {0: EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id=r, new_token_ids=[7],
                         finish_reason=FinishReason.LENGTH if r in done else None)
        for r in req_ids])}


class PluginWrappers:
    """The plugin's wrappers of the loop's calls, each from its patch module."""

    _wrap_schedule = staticmethod(patch_schedule._wrap_schedule)
    _wrap_get_grammar_bitmask = staticmethod(patch_get_grammar_bitmask._wrap_get_grammar_bitmask)
    _wrap_update_from_output = staticmethod(patch_update_from_output._wrap_update_from_output)


class FloorWrappers:
    """The least any wrapper that queues a step's work for later does on the loop, per wrapped
    call: find its state on the scheduler, read the clock, append to a queue (emptied after the
    dispatch). Played in place of the plugin's wrappers it measures this machine's floor for
    the critical path: what such code costs here right after the loop's wait on the device."""

    def __init__(self) -> None:
        self.queued: deque[tuple[Any, ...]] = deque()

    def _queueing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        queued, clock = self.queued, time.perf_counter_ns

        def wrapped(scheduler: Any, *args: Any) -> Any:
            out = original(scheduler, *args)
            acc = scheduler.__dict__.get(scheduler_accountant.ACCOUNTANT_ATTR)
            queued.append((acc, out, clock()))
            return out

        return wrapped

    _wrap_schedule = _wrap_update_from_output = _queueing

    def _wrap_get_grammar_bitmask(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(scheduler: Any, *args: Any) -> Any:
            self.queued.clear()
            return original(scheduler, *args)

        return wrapped


class LoopTimes(NamedTuple):
    """ns per counted step on the loop: its critical path and the call after the dispatch
    (the device's shadow), with the plugin and without."""

    plugin: list[int]
    bare: list[int]
    plugin_shadow: list[int]
    bare_shadow: list[int]


class PlayedEngine:
    """vLLM's engine loop over a `Workload`, through the plugin's real wrappers of
    `Scheduler.schedule` and `update_from_output` (around stand-in originals that hand back the
    workload's states, each scheduler output naming what finished since the last), aborts
    through a stand-in `finish_requests`, and vLLM's output thread: a thread that serializes
    each batch with vLLM's `MsgpackEncoder.encode_into`, through the plugin's wrapper (`hooked`:
    the accounting runs there, as served) or vLLM's own (it runs on the loop, as in-process)."""

    def __init__(self, acc: EngineAccountant, work: Workload, hooked: bool, step_ns: int,
                 on_encode: Callable[[], None] | None = None) -> None:
        from vllm.v1.serial_utils import MsgpackEncoder

        self.acc, self.work = acc, work
        self.scheduler = SimpleNamespace(requests=work.requests)
        self.scheduler.__dict__[scheduler_accountant.ACCOUNTANT_ATTR] = acc
        scheduler_accountant.ACCOUNTANTS[:] = [acc]
        self.queue: queue.Queue = queue.Queue()
        self.rows: list[bytes] = []  # every batch's rows block, in the order sent
        self.finished: set[str] = set()  # finished since the last schedule (`run`)
        self.picks: list[bytes | None] = []  # and the positions of the outputs they are for
        self.batches: list[list[Any]] = []  # the outputs of every batch sent
        # Per batch, in the order queued: the steps the plugin's lane had updated then (a batch
        # of a step's outputs: that step's number, from 1; a measured engine's held outputs go
        # out on batches of their own, later). `_put` keeps it in the queue's order.
        self.queued_at: list[int] = []
        self.steps_updated = 0
        self._put_lock = threading.Lock()
        self.mro = SimpleNamespace(**{STEP_TIME_ATTR: KnownStepTime(step_ns, HOST_TIMER)})
        self.phase = ""  # what the loop is in (tests ask where the accounting ran)
        encoder = MsgpackEncoder()
        original = MsgpackEncoder.encode_into
        # The plugin's CPU on the output thread, per batch sent (ns; its wrapper's thread time
        # less vLLM's encoding): the accounting calls that thread runs.
        self.output_thread_ns: list[int] = []
        vllm_ns = [0]

        def vllm_encode(encoder: Any, obj: Any, buf: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return original(encoder, obj, buf)
            finally:
                vllm_ns[0] += time.thread_time_ns() - t0

        encode = patch_encode_into._wrap_encode_into(vllm_encode) if hooked else vllm_encode

        def output_thread() -> None:
            while (item := self.queue.get()) is not None:
                if on_encode is not None:
                    on_encode()
                _, outputs = item
                vllm_ns[0] = 0
                t0 = time.thread_time_ns()
                encode(encoder, outputs, bytearray())
                self.output_thread_ns.append(time.thread_time_ns() - t0 - vllm_ns[0])
                params = outputs.outputs[0].kv_transfer_params if outputs.outputs else None
                self.rows.append(bytes(params[ROWS_KEY]) if params else b"")
                self.picks.append(params.get(PICKS_KEY) if params else None)
                self.batches.append(list(outputs.outputs))

        self.thread = threading.Thread(target=output_thread, name="output-thread", daemon=True)
        self.thread.start()
        if hooked:  # a served engine: it sends outputs of its own (held ones)
            acc.put_outputs = self.send

    def picked(self, b: int) -> list[int]:
        """The positions of batch `b`'s outputs that got a row (without a picks list: all of
        them if it carried rows, else none)."""
        picks = self.picks[b]
        if picks is None:
            return list(range(len(self.batches[b]))) if self.rows[b] else []
        return np.frombuffer(picks, PICK_DTYPE).tolist()

    def sent(self) -> dict[tuple[str, int], tuple[int, bytes | None]]:
        """Every output sent, by (request, its k-th output): the batch it went out in and the
        row it carried (None: none). A request's outputs leave in order; a finishing one may
        be held and leave in a later batch."""
        from vllm_piep.runtime.record import ROW_BYTES

        out: dict[tuple[str, int], tuple[int, bytes | None]] = {}
        seen: dict[str, int] = {}
        for b, outs in enumerate(self.batches):
            block = self.rows[b]
            picked = {i: block[k * ROW_BYTES:(k + 1) * ROW_BYTES]
                      for k, i in enumerate(self.picked(b))}
            for i, output in enumerate(outs):
                k = seen.get(output.request_id, 0)
                seen[output.request_id] = k + 1
                out[output.request_id, k] = (b, picked.get(i))
        return out

    def finish_steps(self) -> dict[str, int]:
        """For each request that finished with an output: the step whose update its finishing
        output's batch was queued after (`queued_at`)."""
        return {out.request_id: self.queued_at[b] for b, outs in enumerate(self.batches)
                for out in outs if out.finish_reason is not None}

    def _put(self, client: int, outputs: Any) -> None:
        """A batch into the output queue, with the steps updated so far (`queued_at`)."""
        with self._put_lock:
            self.queued_at.append(self.steps_updated)
            self.queue.put_nowait((client, outputs))

    def send(self, client: int, outs: list[Any]) -> None:
        """Outputs on a batch of their own, as the engine core puts them in its queue."""
        from vllm.v1.engine import EngineCoreOutputs

        self._put(client, EngineCoreOutputs(outputs=outs))

    def put_outputs(self, client: int, outs: list[Any]) -> None:
        """The measured mode's held outputs, as the engine core sends them."""
        output_records.attach_to(self.acc, client, outs, counts=True)
        self.send(client, outs)

    def run(self, steps: int, async_scheduling: bool, device: Callable[[], None],
            floor: bool = False,
            timed: Callable[[bool, str, Callable[..., Any]], Callable[..., Any]] | None = None,
            clock: Callable[[], int] = time.perf_counter_ns) -> LoopTimes:
        """`steps` engine steps (`device` runs while the loop waits for each), played twice,
        in turns (`in_turns`): through the plugin's wrappers, on this engine, and through the
        bare originals, on a copy of its workload. Returns the nanoseconds each lane's loop
        spent in the calls, per step, the waits excluded. `floor`: `FloorWrappers` instead of
        the plugin's (nothing is accounted). `timed(plugin, name, call)`: what each lane calls
        in place of its loop's calls (schedule, grammar, update, finish), e.g. a timer around
        them; both lanes get it, so that what it costs cancels in their difference. `clock`:
        what times the calls (wall time, or the loop thread's CPU time, which a loaded machine
        does not stretch)."""
        wrappers = FloorWrappers() if floor else PluginWrappers
        from vllm.v1.request import RequestStatus

        aborted_status = RequestStatus.FINISHED_ABORTED
        total = steps + (1 if async_scheduling else 0)

        def lane(plugin: bool, work: Workload) -> Iterator[tuple[int, int | None]]:
            """The loop's calls step after step: (ns on the critical path, ns on the call
            after the dispatch, or None for a step that scheduled nothing)."""
            state: dict[str, Any] = {}

            # Called as vLLM's engine core calls them (vLLM 0.32, 0.33: `core.py`): schedule
            # with whether to throttle prefills, finish_requests with the status, positional.
            def bare_schedule(self: Any, throttle_prefills: bool = False) -> Any:
                return state["so"]

            def bare_update(self: Any, so: Any, mro: Any) -> Any:
                return state["outs"]

            def bare_finish(self: Any, ids: list[str], finished_status: Any) -> list[Any]:
                return [work.requests[r] for r in ids]

            def bare_grammar(self: Any, so: Any) -> None:
                return None

            schedule, grammar = bare_schedule, bare_grammar
            update, finish = bare_update, bare_finish
            scheduler = self.scheduler
            if plugin:
                schedule = wrappers._wrap_schedule(bare_schedule)
                grammar = wrappers._wrap_get_grammar_bitmask(bare_grammar)
                update = wrappers._wrap_update_from_output(bare_update)
            else:
                scheduler = SimpleNamespace(requests=work.requests)
            if timed is not None:
                schedule = timed(plugin, "schedule", schedule)
                grammar = timed(plugin, "grammar", grammar)
                update = timed(plugin, "update", update)
                finish = timed(plugin, "finish", finish)

            def phase(name: str) -> None:
                self.phase = name if plugin else "bare"

            in_flight: list[tuple[Any, list[str], list[str], list[str]]] = []
            # What vLLM finished since the last schedule (its final output, or an abort): the
            # next scheduler output names them (`finished_req_ids`).
            finished = self.finished if plugin else set()
            for i in range(total):
                path, shade = 0, None
                if i < steps:
                    so, ids, ended, aborted = work.step()
                    so.finished_req_ids = set(finished)
                    finished.clear()
                    state["so"] = so
                    in_flight.append((so, ids, ended, aborted))
                    phase("schedule")
                    t0 = clock()
                    schedule(scheduler, False)
                    t1 = clock()
                    # vLLM asks for the step's grammar bitmask right after dispatching the step.
                    phase("shadow")
                    grammar(scheduler, so)
                    shade = clock() - t1
                    path = t1 - t0
                device()  # the loop waits for the device with the GIL free
                if async_scheduling and i == 0:
                    yield path, shade
                    continue
                so, ids, ended, aborted = in_flight.pop(0)
                state["outs"] = outs = outputs_of(ids, ended)
                phase("update")
                t0 = clock()
                update(scheduler, so, self.mro)
                path += clock() - t0
                finished.update(ended)
                if plugin:
                    self.steps_updated += 1
                    for client, eco in outs.items():
                        self._put(client, eco)
                if aborted:
                    phase("finish")
                    t0 = clock()
                    finish(scheduler, aborted, aborted_status)
                    path += clock() - t0
                    finished.update(aborted)
                yield path, shade

        lanes = {False: lane(False, copy.deepcopy(self.work)), True: lane(True, self.work)}
        got = in_turns(total, lanes)
        return LoopTimes(*([p for p, _ in got[k]] for k in (True, False)),
                         *([s for _, s in got[k] if s is not None] for k in (True, False)))

    def close(self) -> None:
        """The engine goes idle (what is left queued runs, as `flush_idle` does), then the
        output thread stops once it sent everything."""
        acc = self.acc
        with acc.lock:
            acc.deferred.run()
            # vLLM schedules a step of no work to hand over what finished last
            # (`finished_req_ids`).
            acc.release_finished(self.finished)
            self.finished.clear()
        self.queue.put(None)
        self.thread.join()
        scheduler_accountant.ACCOUNTANTS.clear()
