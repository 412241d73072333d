"""Engine core: predict every step's energy and put each request's running total on its output.

`Scheduler.schedule` is wrapped to keep, right after scheduling, what each request computes in
the step (the lists `SchedulerOutput` carries for the workers, by reference).
`update_from_output` is wrapped to predict the step once its output is back (one onnxruntime
call: features, prediction and split), and to attach the outputs' requests' running totals, as
one rows block per batch, to the first output's `kv_transfer_params` (the API server pops it
before vLLM reads the field; `runtime/record.py`). In prediction mode the engine is sparse
(`accountant.py`): only the outputs that finish a request, and every output of a request with
stop strings (which the API server may finish itself), carry a row, and steps are evaluated when
one is read. `finish_requests` is wrapped to free aborted requests' state.

None of that work is on the engine loop's critical path (from a step's output to the next
step's dispatch): the wrappers only keep the step and queue the accountant's calls
(`deferred.py`). The loop runs them once it has handed the next step to the device, while the
device computes it (vLLM asks for the step's grammar bitmask right then:
`Scheduler.get_grammar_bitmask` is wrapped for that). vLLM's output thread waits for them,
without the GIL, before it serializes the outputs they attach records to
(`MsgpackEncoder.encode_into` is wrapped), and runs them itself when the loop has nothing to
dispatch (`_WAIT_FOR_LOOP_S`). An in-process engine (no output thread) runs them inside
`update_from_output`, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from vllm_piep.config import PiepConfig
from vllm_piep.once import OnceLogger, logger
from vllm_piep.predict.base import Predictor
from vllm_piep.predict.loader import load_predictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant, Ready
from vllm_piep.runtime.engine_core.deferred import MAX_QUEUED
from vllm_piep.runtime.engine_core.measured import EngineMeter
from vllm_piep.runtime.engine_core.scheduled import NO_NEW, new_requests, raw_step
from vllm_piep.runtime.patching import Patch
from vllm_piep.runtime.record import HEADER_KEY, PICKS_KEY, ROWS_KEY, encode_picks, encode_rows
from vllm_piep.runtime.vllm_config import engine_cpu_cores, engine_index, model_shape
from vllm_piep.runtime.worker.step import read_step_time

_ATTR = "_piep_accountant"
_LOOP_ATTR = "_piep_loop"  # its `LoopHandle`
# The loop reaches the next dispatch within vLLM's scheduling time (well under this); when it
# has nothing to dispatch (the end of a burst), the output thread runs the calls itself after it.
_WAIT_FOR_LOOP_S = 0.002
_SWEEP_EVERY = 256  # steps between sweeps for requests aborted without a final output
_once = OnceLogger()
# This process's accountants (one per engine core): the output thread waits for their calls.
_ACCOUNTANTS: list[EngineAccountant] = []


def _device(ordinal: int = 0) -> tuple[str, str | None]:
    """The platform's device type and the name of CUDA device `ordinal` (vLLM reads a GPU's
    name through NVML, without initialising CUDA here). A name vLLM cannot read is None: a
    generic profile serves."""
    from vllm.platforms import current_platform

    device_type = str(current_platform.device_type)
    if device_type == "cpu":
        return device_type, None
    try:
        return device_type, str(current_platform.get_device_name(ordinal))
    except Exception as exc:  # noqa: BLE001  (NVML missing or failing)
        _once.warn("reading the device name", exc, "a generic device profile prices energy")
        return device_type, None


def _first_ordinal(vllm_config: Any) -> int:
    """The CUDA ordinal of the engine's first worker (0 where the rule gives NVML indices)."""
    from vllm_piep.runtime.engine_core.engine_gpus import engine_gpus

    try:
        gpus = engine_gpus(vllm_config.parallel_config)
    except Exception:  # noqa: BLE001  (a config it cannot read: the first device)
        return 0
    return gpus.ids[0] if gpus.kind == "cuda" and gpus.ids else 0


def accountant(scheduler: Any) -> EngineAccountant:
    acc = scheduler.__dict__.get(_ATTR)
    if acc is None:
        vllm_config = scheduler.vllm_config

        def make_predictor() -> Predictor:
            from vllm_piep.meters.gpus import first_instance_gpu_facts

            config = PiepConfig.from_sources(vllm_config.additional_config)
            ordinal = _first_ordinal(vllm_config)  # this engine's, not the node's first GPU
            device_type, device_name = _device(ordinal)
            architecture = (vllm_config.model_config.architectures or [None])[0]
            return load_predictor(config, model_shape(vllm_config), device_type, device_name,
                                  architecture,
                                  gpu_facts=partial(first_instance_gpu_facts, ordinal=ordinal),
                                  cpu_cores=engine_cpu_cores(vllm_config)
                                  if device_type == "cpu" else None)

        acc = EngineAccountant(make_predictor, engine_id=str(engine_index(vllm_config)))
        acc.sparse = True
        setattr(scheduler, _ATTR, acc)
        _ACCOUNTANTS.append(acc)
    return acc


class LoopHandle:
    """What the engine loop's wrappers read and write on the critical path, in one small object
    on the scheduler: its accountant, the accountant's clock, its queue of calls, the queue's
    append, and whether the next update is to hand over the scheduler's requests for a sweep.
    The queued calls get the handle, not the accountant. A slot is one load, where each of
    these is a dictionary lookup from the scheduler through the accountant; on the cold caches
    the loop meets after its wait on the device, each object it touches costs up to a
    microsecond here (docs/benchmarks.md)."""

    __slots__ = ("acc", "now_ns", "deferred", "queue", "sweep_due")

    def __init__(self, acc: EngineAccountant) -> None:
        self.acc = acc
        self.now_ns = acc.now_ns
        self.deferred = acc.deferred
        self.queue = acc.deferred.queue
        self.sweep_due = False  # set off the loop every `_SWEEP_EVERY` steps


def loop_handle(scheduler: Any) -> LoopHandle:
    handle = scheduler.__dict__.get(_LOOP_ATTR)
    if handle is None:
        handle = LoopHandle(accountant(scheduler))
        setattr(scheduler, _LOOP_ATTR, handle)
    return handle


def run_deferred(acc: EngineAccountant) -> None:
    """Run the loop's queued accounting calls (any thread). Always under the lock, even with
    an empty queue: another thread may be running the call that attaches this batch's records."""
    with acc.lock:
        acc.deferred.run()


def _start_engine_meter(engine: Any, acc: EngineAccountant) -> None:
    """Measured mode (`measured.py`), once per engine, when the engine has an output queue
    to send held outputs on (an engine-core process; the in-process engine of `LLM` stays in
    prediction mode) and a meter serves."""
    from vllm_piep.meters.factory import meter_factory, reads_gpus
    from vllm_piep.runtime.engine_core.engine_gpus import engine_gpus

    vllm_config = engine.scheduler.vllm_config
    config = PiepConfig.from_sources(vllm_config.additional_config)
    if not config.measured:
        return
    setting = config.meter or "auto"
    ordinals = indices = None
    if _device()[0] == "cuda":
        gpus = engine_gpus(vllm_config.parallel_config)
        if (gpus.elsewhere or gpus.unknown) and reads_gpus(setting):
            if gpus.unknown:
                acc.meter_note, why = gpus.unknown, "a meter could read another engine's GPUs"
            else:
                acc.meter_note = (f"{gpus.elsewhere} of the engine's {gpus.workers} workers "
                                  "run on other nodes")
                why = (f"the meter here reads only this node's GPUs ({gpus.describe()}): "
                       "measured mode would bill part of the engine's energy. Other nodes' "
                       "GPUs are not metered from this one")
            logger.warning(
                "vllm_piep: %s; %s, so the engine stays in prediction mode (responses say "
                "source prior; piep_engine_measured is 0 with this reason).",
                acc.meter_note, why)
            return
        ordinals, indices = (gpus.ids, None) if gpus.kind == "cuda" else (None, gpus.ids)
        logger.info("vllm_piep: engine %s runs on %s", acc.engine_id, gpus.describe())
    factory, label = meter_factory(setting, ordinals, measuring_only=config.meter is None,
                                   nvml_indices=indices)
    send = partial(_put_outputs, engine.output_queue)

    def put_outputs(client: int, outs: list[Any]) -> None:
        _attach_to(acc, client, outs, counts=True)
        send(client, outs)

    def idle_watts() -> float | None:
        with acc.lock:  # the meter thread asks; the predictor may be loading in the engine loop
            predictor = acc.predictor
        if getattr(predictor, "idle_watts", None) is not None:  # the prior: idle, not serving
            return float(predictor.idle_watts)
        graph = getattr(predictor, "graph", None)
        spec = getattr(graph, "spec", None)
        return getattr(spec, "static_watts", getattr(predictor, "static_watts", None))

    acc.engine_meter = EngineMeter(acc, factory, label, idle_watts, put_outputs,
                                   flush=lambda: flush_idle(engine)).start()


def _schedule_later(loop: LoopHandle, scheduler_output: Any,
                    requests: dict[str, Any], at_ns: int) -> None:
    if scheduler_output.total_num_scheduled_tokens <= 0:
        return
    acc = loop.acc
    new_reqs = scheduler_output.scheduled_new_reqs
    new = new_requests(new_reqs, requests) if new_reqs else NO_NEW
    if new.dense:
        acc.dense_ids.update(new.dense)
    # Converted when the step is evaluated (a sparse engine: not after every step).
    acc.on_schedule(id(scheduler_output), partial(raw_step, scheduler_output, new),
                    at_ns=at_ns)


def _wrap_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    # The engine loop's wrappers mirror their originals' parameters (`Patch.signature`):
    # `*args, **kwargs` would build a tuple and a dict per call, on the critical path.
    def schedule(self: Any, throttle_prefills: bool = False) -> Any:
        out = original(self, throttle_prefills)
        try:
            # On the loop's critical path: the scheduler output and the scheduler's requests
            # are kept by reference (copying or looking up touches every element, slow on a
            # cold cache); the new requests are read off the loop (`new_requests`), and so is
            # whether the step schedules anything.
            loop = self.__dict__.get(_LOOP_ATTR) or loop_handle(self)
            loop.queue((_schedule_later, (loop, out, self.requests, loop.now_ns())))
            if not loop.deferred.off_loop:
                # Nothing runs the calls off the loop yet: run them now, before a request of
                # this step can leave the scheduler. (The update's wrapper, one per step, also
                # runs them when too many wait.)
                run_deferred(loop.acc)
        except Exception as exc:  # boundary: never break scheduling
            _count_failure(self, "reading the scheduled step", exc)
            try:
                acc = accountant(self)
                acc.deferred.add(acc.mark_incomplete, list(out.num_scheduled_tokens))
            except Exception:
                pass  # already counted and logged above
        return out

    return schedule


def _update_done(loop: LoopHandle, scheduler_output: Any, model_runner_output: Any,
                 at_ns: int, outputs: dict[int, Any] | None, live: set[str] | None) -> None:
    """A step's update, queued in one call: the step is done (at `at_ns`), then the requests
    vLLM finished inside `update_from_output` (errors: `_note_errored`, queued before this
    call) are released, held until this step's outputs carried their totals (`outputs`: None
    when the update raised). `live`: the scheduler's requests, when a sweep was due."""
    acc = loop.acc
    errored = acc.errored_in_update
    if errored:
        acc.errored_in_update = []
        acc.hold_releases()
    try:
        step_ns, timer = read_step_time(model_runner_output)  # a GPU's: read from its events
        acc.on_step_done(id(scheduler_output), step_ns, timer, at_ns=at_ns)
    finally:  # a step that failed is counted; its outputs still go out with their records
        try:
            for req_id in errored:
                acc.release(req_id)
            if outputs is not None:
                acc.loop_steps += 1
                if acc.loop_steps % _SWEEP_EVERY == 0:
                    loop.sweep_due = True  # the loop hands the next update its requests
                if live is not None:
                    loop.sweep_due = False
                # A copy, taken here: vLLM adds an entry to an empty dict after the update
                # (`_attach_iteration_details`) and sends what this call attaches.
                _attach_records(acc, dict(outputs), live)
        finally:
            if errored:
                acc.release_held()


def _wrap_update_from_output(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        # On the critical path: the outputs and the model output are kept by reference (the
        # step time is read off the loop), and the scheduler's requests are read only when the
        # call queued before asked for a sweep.
        loop = self.__dict__.get(_LOOP_ATTR)
        if loop is None:  # the first step
            try:
                loop = loop_handle(self)
            except Exception as exc:  # boundary
                _count_failure(self, "accounting a step", exc)
                return original(self, scheduler_output, model_runner_output)
        at_ns = loop.now_ns()
        outputs = None
        try:
            outputs = original(self, scheduler_output, model_runner_output)
        finally:
            try:
                loop.queue((_update_done, (
                    loop, scheduler_output, model_runner_output, at_ns, outputs,
                    set(self.requests) if loop.sweep_due else None)))
                if not loop.deferred.off_loop or len(loop.deferred.calls) > MAX_QUEUED:
                    run_deferred(loop.acc)
            except Exception as exc:  # boundary
                _count_failure(self, "accounting a step", exc)
        return outputs

    return update_from_output


def _attach_records(acc: EngineAccountant, outputs: dict[int, Any],
                    live: set[str] | None = None) -> None:
    """One rows block and the step header on the first output of each client's batch
    (`vllm_piep.runtime.record`); requests that finished with this output are released after.
    Finishing outputs whose steps wait (for the meter, or for the log's pass) are held and go
    out later; held ones now ready join their client's batch, or go out on their own.
    `live`: the scheduler's requests, to sweep those it no longer has."""
    meter: EngineMeter | None = acc.engine_meter
    if meter is not None and acc.splitter is not None:
        _hold_unsettled(meter, outputs)
    elif acc.sparse and acc.put_outputs is not None:
        _attach_served(acc, outputs)
        if live is not None:
            acc.sweep(live, every=0)
        return
    # The engine's counts go to one client only, each increment once: several API servers'
    # /metrics are summed.
    counts_to = min((c for c, eo in outputs.items() if eo.outputs), default=None)
    for client, engine_outputs in outputs.items():
        if engine_outputs.outputs:
            _attach_to(acc, client, engine_outputs.outputs, client == counts_to)
    if live is not None:
        acc.sweep(live, every=0)


def _attach_served(acc: EngineAccountant, outputs: dict[int, Any]) -> None:
    """`_attach_records` in prediction mode on a served engine, each batch read once: its
    finishing outputs are held while steps wait in the log (`accountant.py`), and go out
    with the pass that evaluates them; the log is evaluated now when a held output has waited
    `HOLD_S`, or when the batch has an output of a request whose every output carries its
    row (then nothing waits)."""
    dense = acc.dense_ids
    if acc.pass_due() or (dense and any(out.request_id in dense
                                        for engine_outputs in outputs.values()
                                        for out in engine_outputs.outputs)):
        acc.evaluate()
    holding = acc.holds_outputs()
    batches: list[tuple[int, Any, list[int]]] = []
    for client, engine_outputs in outputs.items():
        outs = engine_outputs.outputs
        if not outs:
            continue
        ends = [i for i, out in enumerate(outs) if out.finish_reason is not None]
        if ends and holding:
            for i in ends:
                acc.hold(client, outs[i])
            engine_outputs.outputs = [out for out in outs if out.finish_reason is None]
            ends = []
        batches.append((client, engine_outputs, ends))
    ready = _by_client(acc.take_ready()) if acc.ready else {}
    counts_to = min((c for c, eo, _ in batches if eo.outputs or c in ready), default=None)
    for client, engine_outputs, ends in batches:
        held = ready.pop(client, None)
        if engine_outputs.outputs or held:
            _attach_to(acc, client, engine_outputs.outputs, client == counts_to, held, ends)
    _send_ready(acc, ready)


def _by_client(ready: list[Ready]) -> dict[int, list[Ready]]:
    by_client: dict[int, list[Ready]] = {}
    for r in ready:
        by_client.setdefault(r.client, []).append(r)
    return by_client


def _send_ready(acc: EngineAccountant, ready: dict[int, list[Ready]]) -> None:
    """Held outputs a pass released, out on their own batch per client."""
    for client, held in ready.items():
        outs: list[Any] = []
        _attach_to(acc, client, outs, True, held)
        assert acc.put_outputs is not None, "only an engine that sends outputs holds them"
        acc.put_outputs(client, outs)


def _attach_to(acc: EngineAccountant, client: int, outs: list[Any], counts: bool,
               ready: list[Ready] | None = None, ends: list[int] | None = None) -> None:
    """The rows block and the header on the first of these outputs, one client's; the
    requests that finished with them are released after. `ready`: held outputs a pass
    released, appended to `outs` with the rows the pass gave them (already released). `ends`:
    the positions of the outputs that finish a request, where the caller has them. A sparse
    engine gives rows only to the outputs that finish a request or whose request has stop
    strings, and attaches nothing when there are none and no new counts."""
    n_own = len(outs)
    if ends is None:
        ends = [i for i, out in enumerate(outs) if out.finish_reason is not None]
    picks: list[int] | None = None
    if acc.sparse:
        dense = acc.dense_ids
        picks = ends if not dense else [
            i for i, out in enumerate(outs)
            if out.finish_reason is not None or out.request_id in dense]
        if ready:
            picks = [*picks, *range(n_own, n_own + len(ready))]
            outs.extend(r.output for r in ready)
        if not picks and not (counts and acc.counts_due()):
            return
        block = acc.encode([outs[i].request_id for i in picks if i < n_own])
        if ready:
            block += encode_rows(np.stack([r.row for r in ready]))
        if len(picks) == len(outs):
            picks = None
    else:
        block = acc.encode([out.request_id for out in outs])
    for i in ends:
        acc.release(outs[i].request_id, aborted=False)
    header = acc.header(counts=counts)
    if counts:
        acc.counts_client = client
    extra = {HEADER_KEY: header.encode(), ROWS_KEY: block}
    if picks is not None:
        extra[PICKS_KEY] = encode_picks(picks)
    first = outs[0]
    params = first.kv_transfer_params
    first.kv_transfer_params = {**params, **extra} if params else extra


def _hold_unsettled(meter: EngineMeter, outputs: dict[int, Any]) -> None:
    """Measured mode: finished requests whose last steps wait for the meter leave this batch
    to wait (`measured.py`); held ones now settled join it, or go out on their own when this
    batch has nothing for their client (this batch may already be queued)."""
    acc = meter.acc
    alone = []
    for held in meter.settle_in_loop():
        if held.client in outputs:
            outputs[held.client].outputs.append(held.output)
        else:
            alone.append(held)
    meter.send(alone)
    done = acc.steps_done  # this step's among them
    for client, engine_outputs in outputs.items():
        outs = engine_outputs.outputs
        if not any(out.finish_reason is not None and acc.unsettled(out.request_id, done)
                   for out in outs):
            continue
        keep = []
        for out in outs:
            if out.finish_reason is not None and acc.unsettled(out.request_id, done):
                meter.hold(client, out)
            else:
                keep.append(out)
        engine_outputs.outputs = keep


def _put_outputs(queue: Any, client: int, outs: list[Any]) -> None:
    """Outputs into the engine's output queue, as a batch of their own."""
    from vllm.v1.engine import EngineCoreOutputs

    queue.put_nowait((client, EngineCoreOutputs(outputs=outs)))


FLUSH_REQUEST_ID = "piep-idle-flush"  # no request has it: vLLM's API server skips the output


def flush_idle(engine: Any) -> None:
    """An idle engine: the log evaluated, held outputs sent, and its counts not yet sent (the
    last steps' energy, aborts while idle, the tracked requests back to zero) out on an output
    of their own, which no request owns: without it they would wait for the next request."""
    scheduler = getattr(engine, "scheduler", None)
    queue = getattr(engine, "output_queue", None)  # an in-process engine (LLM) has none
    if scheduler is None or queue is None:
        return
    acc = scheduler.__dict__.get(_ATTR)
    if acc is None:
        if not hasattr(scheduler, "vllm_config"):
            return
        acc = accountant(scheduler)  # idle at start: meet it now
    if acc.put_outputs is None:  # this engine sends outputs: finishing ones may be held
        acc.put_outputs = partial(_put_outputs, queue)
    with acc.lock:
        # Idle: every request the scheduler no longer has is released now (an abort that
        # raced a step leaves one behind), not at the next request's periodic sweep.
        acc.deferred.run()
        acc.sweep(getattr(scheduler, "requests", None) or (), every=0)
        acc.evaluate()
        _send_ready(acc, _by_client(acc.take_ready()))
    if not acc.meter_tried and hasattr(scheduler, "vllm_config"):
        acc.meter_tried = True
        try:
            _start_engine_meter(engine, acc)
        except Exception as exc:  # boundary: no measured mode, never a failed start
            _once.warn("starting measured mode", exc, "responses carry the model's prediction")
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    with acc.lock:
        if not acc.unreported():
            return
        params = {HEADER_KEY: acc.header(counts=True).encode(), ROWS_KEY: b""}
    output = EngineCoreOutput(request_id=FLUSH_REQUEST_ID, new_token_ids=[],
                              kv_transfer_params=params)
    queue.put_nowait((acc.counts_client, EngineCoreOutputs(outputs=[output])))


def _wrap_notify_idle(original: Callable[..., Any]) -> Callable[..., Any]:
    def _notify_idle_state_callbacks(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            flush_idle(self)
        except Exception as exc:  # boundary
            _once.warn("sending an idle engine's energy", exc,
                       "/metrics shows it with the next request")
        return result

    return _notify_idle_state_callbacks


def _finished_inside_update(finished_status: Any) -> bool:
    """Whether `finish_requests` was called by vLLM's `update_from_output`: there vLLM finishes
    requests only as errored (FINISHED_ERROR, then a final output in the same batch), from
    outside (aborts, streaming input's end) only as aborted (vLLM 0.32, 0.33)."""
    return getattr(finished_status, "name", finished_status) == "FINISHED_ERROR"


def _wrap_finish_requests(original: Callable[..., Any]) -> Callable[..., Any]:
    def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
        finished = original(self, request_ids, finished_status)
        try:
            acc = self.__dict__.get(_ATTR)
            if acc is not None and isinstance(finished, list) and finished:
                req_ids = [getattr(request, "request_id", request) for request in finished]
                if _finished_inside_update(finished_status):  # the step's call releases them
                    acc.deferred.add(_note_errored, acc, req_ids)
                else:  # aborted from outside: no final output comes
                    acc.deferred.add(_release_all, acc, req_ids)
        except Exception as exc:  # boundary
            _count_failure(self, "releasing aborted requests", exc)
        return finished

    return finish_requests


def _note_errored(acc: EngineAccountant, req_ids: list[str]) -> None:
    """Requests vLLM finished inside an update: that update's call (queued next) releases
    them once its outputs carried their totals."""
    acc.errored_in_update.extend(req_ids)


def _release_all(acc: EngineAccountant, req_ids: list[str]) -> None:
    for req_id in req_ids:
        acc.release(req_id)


def _wrap_get_grammar_bitmask(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_grammar_bitmask(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        acc = self.__dict__.get(_ATTR)
        if acc is not None and acc.deferred.off_loop:
            # The step is on the device: the loop accounts the steps before it in its shadow.
            try:
                run_deferred(acc)
            except Exception as exc:  # boundary
                _count_failure(self, "accounting a step", exc)
        return result

    return get_grammar_bitmask


def _wrap_encode_into(original: Callable[..., Any]) -> Callable[..., Any]:
    def encode_into(self: Any, obj: Any, buf: Any) -> Any:
        if _ACCOUNTANTS:  # an engine core's output thread, about to send a batch of outputs
            try:
                for acc in _ACCOUNTANTS:
                    acc.deferred.off_loop = True
                    # The loop runs them once it has handed the next step to the device;
                    # waiting here leaves it the GIL.
                    acc.deferred.wait_run(_WAIT_FOR_LOOP_S)
                    run_deferred(acc)
            except Exception as exc:  # boundary: the outputs go out regardless
                _once.warn("accounting steps on the output thread", exc,
                           "energy of the affected requests may be missing")
        return original(self, obj, buf)

    return encode_into


def _count_failure(scheduler: Any, where: str, exc: BaseException) -> None:
    try:
        accountant(scheduler).errors += 1
    except Exception:
        pass
    _once.warn(where, exc, "energy of the affected requests may be missing")


def patches() -> list[Patch]:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.serial_utils import MsgpackEncoder

    return [
        Patch(Scheduler, "schedule", _wrap_schedule,
              why="captures each scheduled request's new tokens and context for the step",
              how="after the original, keeps the scheduler output and the scheduler's dict "
                  "of requests by reference and queues the step for the accountant, which reads "
                  "the lists it carries for the workers and its new requests off the loop",
              until="vLLM offers a per-step hook with the scheduler output",
              signature="(self, throttle_prefills=False)"),
        Patch(Scheduler, "update_from_output", _wrap_update_from_output,
              why="predicts the step's energy, splits it, attaches running totals to outputs",
              how="after the original, queues one call, run once the next step is "
                  "dispatched: predicting and splitting the step (with the worker's step time), "
                  "releasing the requests the original finished (errors) once the rows block is "
                  "on each client's first output's kv_transfer_params",
              until="vLLM offers a per-step hook with the scheduler and model outputs, and a "
                    "field on EngineCoreOutput for plugins",
              signature="(self, scheduler_output, model_runner_output)"),
        Patch(Scheduler, "finish_requests", _wrap_finish_requests,
              why="frees the state of requests aborted from outside (client gone, stop "
                  "strings found by the API server)",
              how="after the original, queues the release of the finished requests' rows "
                  "(finished as errored, which vLLM does only inside update_from_output: "
                  "hands them to that step's call)",
              until="vLLM offers a request-finished callback in the engine core",
              signature="(self, request_ids, finished_status)"),
        Patch(MsgpackEncoder, "encode_into", _wrap_encode_into,
              why="the outputs of a batch go out only once the step accounting the engine "
                  "loop queued before them has run (it attaches their records)",
              how="before the original, when this process has an engine accountant: waits "
                  "(without the GIL, up to 2 ms) for the loop to run its queued calls, then "
                  "runs what is left under its lock (the API server's encoders find none)",
              until="vLLM offers a per-step hook off the engine loop's critical path, and a "
                    "field on EngineCoreOutput for plugins"),
        Patch(Scheduler, "get_grammar_bitmask", _wrap_get_grammar_bitmask,
              why="the loop accounts the steps before it while the device computes the step "
                  "it has just handed over (off the critical path)",
              how="after the original (called right after each step is dispatched), runs the "
                  "queued accounting calls under the accountant's lock",
              until="vLLM offers a per-step hook off the engine loop"),
        Patch(EngineCoreProc, "_notify_idle_state_callbacks", _wrap_notify_idle,
              why="an idle engine's last counts reach /metrics without waiting for the next "
                  "request",
              how="after the original (called while the engine has no work), puts the counts "
                  "not yet sent on an output no request owns, in the engine's output queue",
              until="vLLM's engine core exports plugin metrics, or has an idle hook"),
    ]
