"""Engine core: the accountant each vLLM scheduler carries (`accountant`), made at its first use
with the engine's predictor, and the small handle the engine loop's wrappers read on the
critical path (`LoopHandle`). The loop's queued calls run with `run_deferred`."""

from __future__ import annotations

from functools import partial
from typing import Any

from vllm_piep.config import PiepConfig
from vllm_piep.once import OnceLogger
from vllm_piep.predict.base import Predictor
from vllm_piep.predict.loader import load_predictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.vllm_config import device, engine_cpu_cores, engine_index, model_shape

ACCOUNTANT_ATTR = "_piep_accountant"
LOOP_ATTR = "_piep_loop"  # its `LoopHandle`
_once = OnceLogger()
# This process's accountants (one per engine core): the output thread waits for their calls.
ACCOUNTANTS: list[EngineAccountant] = []


def _first_ordinal(vllm_config: Any) -> int:
    """The CUDA ordinal of the engine's first worker (0 where the rule gives NVML indices)."""
    from vllm_piep.runtime.engine_core.engine_gpus import engine_gpus

    try:
        gpus = engine_gpus(vllm_config.parallel_config)
    except Exception:  # noqa: BLE001  (a config it cannot read: the first device)
        return 0
    return gpus.ids[0] if gpus.kind == "cuda" and gpus.ids else 0


def accountant(scheduler: Any) -> EngineAccountant:
    acc = scheduler.__dict__.get(ACCOUNTANT_ATTR)
    if acc is None:
        vllm_config = scheduler.vllm_config

        def make_predictor() -> Predictor:
            from vllm_piep.meters.device_facts import instance_gpu_facts

            config = PiepConfig.from_sources(vllm_config.additional_config)
            ordinal = _first_ordinal(vllm_config)  # this engine's, not the node's first GPU
            device_type, device_name = device(ordinal)
            architecture = (vllm_config.model_config.architectures or [None])[0]
            return load_predictor(config, model_shape(vllm_config), device_type, device_name,
                                  architecture,
                                  gpu_facts=partial(instance_gpu_facts, ordinal=ordinal),
                                  cpu_cores=engine_cpu_cores(vllm_config)
                                  if device_type == "cpu" else None)

        acc = EngineAccountant(make_predictor, engine_id=str(engine_index(vllm_config)))
        acc.sparse = True
        setattr(scheduler, ACCOUNTANT_ATTR, acc)
        ACCOUNTANTS.append(acc)
    return acc


class LoopHandle:
    """What the engine loop's wrappers read and write on the critical path, in one small object
    on the scheduler: its accountant, the accountant's clock, its queue of calls, the queue's
    append, whether the next update is to look for requests the scheduler dropped (a sweep),
    and the accountant's tracked requests it compares with the scheduler's then.
    The queued calls get the handle, not the accountant. A slot is one load, where each of
    these is a dictionary lookup from the scheduler through the accountant; on the cold caches
    the loop meets after its wait on the device, each object it touches costs up to a
    microsecond here (docs/benchmarks.md)."""

    __slots__ = ("acc", "now_ns", "deferred", "queue", "sweep_due", "tracked")

    def __init__(self, acc: EngineAccountant) -> None:
        self.acc = acc
        self.now_ns = acc.now_ns
        self.deferred = acc.deferred
        self.queue = acc.deferred.queue
        self.sweep_due = False  # set off the loop every `_SWEEP_EVERY` steps
        self.tracked = acc.table.slots  # the requests tracked, by id (read for a sweep)


def loop_handle(scheduler: Any) -> LoopHandle:
    handle = scheduler.__dict__.get(LOOP_ATTR)
    if handle is None:
        handle = LoopHandle(accountant(scheduler))
        setattr(scheduler, LOOP_ATTR, handle)
    return handle


def run_deferred(acc: EngineAccountant) -> None:
    """Run the loop's queued accounting calls (any thread). Always under the lock, even with
    an empty queue: another thread may be running the call that attaches this batch's records."""
    with acc.lock:
        acc.deferred.run()


def count_failure(scheduler: Any, where: str, exc: BaseException) -> None:
    try:
        accountant(scheduler).errors += 1
    except Exception:
        pass
    _once.warn(where, exc, "energy of the affected requests may be missing")
