"""A played engine loop for tests and benchmarks: seeded scheduler states step after step, as
vLLM's scheduler hands them to the plugin's wrappers (the attributes they read), and the real
vLLM outputs of each step."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from vllm_piep.runtime.engine_core import scheduler as hooks
from vllm_piep.runtime.engine_core.accounting import EngineAccountant
from vllm_piep.runtime.record import PICK_DTYPE, PICKS_KEY, ROWS_KEY
from vllm_piep.runtime.worker.step import STEP_NS_ATTR, STEP_TIMER_ATTR

CONTEXT, PROMPT = (90, 110), 32


class Workload:
    """Seeded scheduler states, step after step: the same sequence for every placement."""

    def __init__(self, n: int, seed: int, finish_p: float = 0.01, abort_p: float = 0.0025,
                 stop_p: float = 0.0) -> None:
        self.finish_p, self.abort_p = finish_p, abort_p
        self.rng = random.Random(seed)
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
            self.live[rid] = [computed, computed - PROMPT, PROMPT]
        self.with_stop.clear()  # running before the plugin saw them: it never reads theirs
        self.fresh: list[str] = []

    def _new(self) -> str:
        rid = f"req-{self.next_id}"
        self.next_id += 1
        stop = ["\n\n"] if self.stop_rng.random() < self.stop_p else []
        if stop:
            self.with_stop.add(rid)
        self.requests[rid] = SimpleNamespace(num_prompt_tokens=PROMPT, num_output_tokens=0,
                                             request_id=rid,
                                             sampling_params=SimpleNamespace(stop=stop))
        return rid

    def step(self) -> tuple[Any, list[str], list[str], list[str]]:
        """(the scheduler output, its requests, those that end with this step, those aborted
        from outside after it)."""
        cached = [r for r in self.live if r not in self.fresh]
        new = [SimpleNamespace(req_id=r, num_computed_tokens=0, prompt_token_ids=[7] * PROMPT,
                               prompt_embeds=None,
                               sampling_params=self.requests[r].sampling_params)
               for r in self.fresh]
        scheduled = {r: 1 for r in cached} | {r: PROMPT for r in self.fresh}
        out = SimpleNamespace(
            total_num_scheduled_tokens=sum(scheduled.values()),
            num_scheduled_tokens=scheduled, scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=cached, num_computed_tokens=[self.live[r][0] for r in cached],
                num_output_tokens=[self.live[r][1] for r in cached]),
            scheduled_spec_decode_tokens={})
        for r, n in scheduled.items():
            self.live[r][0] += n
            self.live[r][1] += 1
        self.fresh = []
        ended = [r for r in self.live if self.rng.random() < self.finish_p]
        aborted = [r for r in self.live if r not in ended and self.rng.random() < self.abort_p]
        for r in ended + aborted:
            del self.live[r]
        for _ in range(len(ended) + len(aborted)):
            rid = self._new()
            self.live[rid] = [0, 0, PROMPT]
            self.fresh.append(rid)
        return out, list(scheduled), ended, aborted


def wrapped_minus_bare(call: Callable[[], Any], bare: Callable[[], Any]) -> tuple[int, Any]:
    """ns a wrapped call takes beyond its bare original, the bare one timed right before it
    (both meet the same caches), and what the wrapped call returned."""
    clock = time.perf_counter_ns
    t0 = clock()
    bare()
    t1 = clock()
    result = call()
    return (clock() - t1) - (t1 - t0), result


def outputs_of(req_ids: list[str], ended: list[str]) -> dict[int, Any]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    done = set(ended)
    return {0: EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id=r, new_token_ids=[7],
                         finish_reason=FinishReason.LENGTH if r in done else None)
        for r in req_ids])}


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
            queued.append((scheduler.__dict__.get(hooks._ATTR), out, clock()))
            return out

        return wrapped

    _wrap_schedule = _wrap_update_from_output = _wrap_finish_requests = _queueing

    def _wrap_get_grammar_bitmask(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(scheduler: Any, *args: Any) -> Any:
            self.queued.clear()
            return original(scheduler, *args)

        return wrapped


class PlayedEngine:
    """vLLM's engine loop over a `Workload`, through the plugin's real wrappers of
    `Scheduler.schedule`, `update_from_output` and `finish_requests` (around stand-in originals
    that hand back the workload's states), and vLLM's output thread: a thread that serializes
    each batch with vLLM's `MsgpackEncoder.encode_into`, through the plugin's wrapper (`hooked`:
    the accounting runs there, as served) or vLLM's own (it runs on the loop, as in-process)."""

    def __init__(self, acc: EngineAccountant, work: Workload, hooked: bool, step_ns: int,
                 on_encode: Callable[[], None] | None = None) -> None:
        from vllm.v1.serial_utils import MsgpackEncoder

        self.acc, self.work = acc, work
        self.scheduler = SimpleNamespace(requests=work.requests)
        self.scheduler.__dict__[hooks._ATTR] = acc
        hooks._ACCOUNTANTS[:] = [acc]
        self.queue: queue.Queue = queue.Queue()
        self.rows: list[bytes] = []  # every batch's rows block, in the order sent
        self.picks: list[bytes | None] = []  # and the positions of the outputs they are for
        self.batches: list[list[Any]] = []  # the outputs of every batch sent
        self.mro = SimpleNamespace(**{STEP_NS_ATTR: step_ns, STEP_TIMER_ATTR: "perf_counter"})
        self._state: dict[str, Any] = {}
        self.phase = ""  # what the loop is in (tests ask where the accounting ran)
        self.shadow: list[int] = []  # the loop's ns per step in the device's shadow
        encoder = MsgpackEncoder()
        original = MsgpackEncoder.encode_into
        encode = hooks._wrap_encode_into(original) if hooked else original

        def output_thread() -> None:
            while (item := self.queue.get()) is not None:
                if on_encode is not None:
                    on_encode()
                _, outputs = item
                encode(encoder, outputs, bytearray())
                params = outputs.outputs[0].kv_transfer_params if outputs.outputs else None
                self.rows.append(bytes(params[ROWS_KEY]) if params else b"")
                self.picks.append(params.get(PICKS_KEY) if params else None)
                self.batches.append(list(outputs.outputs))

        self.thread = threading.Thread(target=output_thread, name="output-thread", daemon=True)
        self.thread.start()

    def picked(self, b: int) -> list[int]:
        """The positions of batch `b`'s outputs that got a row (without a picks list: all of
        them if it carried rows, else none)."""
        picks = self.picks[b]
        if picks is None:
            return list(range(len(self.batches[b]))) if self.rows[b] else []
        return np.frombuffer(picks, PICK_DTYPE).tolist()

    def put_outputs(self, client: int, outs: list[Any]) -> None:
        """The measured mode's held outputs, as the engine core sends them."""
        from vllm.v1.engine import EngineCoreOutputs

        hooks._attach_to(self.acc, client, outs, counts=True)
        self.queue.put_nowait((client, EngineCoreOutputs(outputs=outs)))

    def run(self, steps: int, async_scheduling: bool, device: Callable[[], None],
            floor: bool = False) -> list[int]:
        """`steps` engine steps (`device` runs while the loop waits for each); the plugin's
        nanoseconds on the loop per step: the wrapped calls minus the bare originals. `floor`:
        `FloorWrappers` instead of the plugin's (nothing is accounted)."""
        state, work, scheduler = self._state, self.work, self.scheduler
        wrappers = FloorWrappers() if floor else hooks

        # Called as vLLM's engine core calls them (vLLM 0.32, 0.33: `core.py`): schedule with
        # whether to throttle prefills, finish_requests with the status, both positional.
        def bare_schedule(self: Any, throttle_prefills: bool = False) -> Any:
            return state["so"]

        def bare_update(self: Any, so: Any, mro: Any) -> Any:
            return state["outs"]

        def bare_finish(self: Any, ids: list[str], finished_status: Any) -> list[Any]:
            return [work.requests[r] for r in ids]

        def bare_grammar(self: Any, so: Any) -> None:
            return None

        schedule = wrappers._wrap_schedule(bare_schedule)
        grammar = wrappers._wrap_get_grammar_bitmask(bare_grammar)
        update = wrappers._wrap_update_from_output(bare_update)
        finish = wrappers._wrap_finish_requests(bare_finish)
        from vllm.v1.request import RequestStatus

        aborted_status = RequestStatus.FINISHED_ABORTED

        costs: list[int] = []
        shadow: list[int] = []
        in_flight: list[tuple[Any, list[str], list[str], list[str]]] = []
        for i in range(steps + (1 if async_scheduling else 0)):
            cost = 0
            if i < steps:
                so, ids, ended, aborted = work.step()
                state["so"] = so
                self.phase = "schedule"
                cost += wrapped_minus_bare(lambda: schedule(scheduler, False),
                                           lambda: bare_schedule(scheduler, False))[0]
                in_flight.append((so, ids, ended, aborted))
                # vLLM asks for the step's grammar bitmask right after dispatching the step.
                self.phase = "shadow"
                shadow.append(wrapped_minus_bare(lambda: grammar(scheduler, so),
                                                 lambda: bare_grammar(scheduler, so))[0])
            device()  # the loop waits for the device with the GIL free
            if async_scheduling and i == 0:
                costs.append(cost)
                continue
            so, ids, ended, aborted = in_flight.pop(0)
            state["outs"] = outs = outputs_of(ids, ended)
            self.phase = "update"
            cost += wrapped_minus_bare(lambda: update(scheduler, so, self.mro),
                                       lambda: bare_update(scheduler, so, self.mro))[0]
            for client, eco in outs.items():
                self.queue.put_nowait((client, eco))
            if aborted:
                self.phase = "finish"
                cost += wrapped_minus_bare(lambda: finish(scheduler, aborted, aborted_status),
                                           lambda: bare_finish(scheduler, aborted,
                                                               aborted_status))[0]
            costs.append(cost)
        self.shadow = shadow
        return costs

    def close(self) -> None:
        """Stop the output thread once it sent everything; run what is left queued."""
        self.queue.put(None)
        self.thread.join()
        with self.acc.lock:
            self.acc.deferred.run()
        hooks._ACCOUNTANTS.clear()
