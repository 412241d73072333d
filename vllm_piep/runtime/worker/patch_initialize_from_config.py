"""Worker: `Worker.initialize_from_config` wrapped so that, where the engine core asked its
workers to meter themselves (`meter_scope`: it exported its sink's address), this worker reads
the devices it drives with the `meter` setting and sends its readings to the engine core on a
thread of its own (`meters/worker_readings.py`). It runs once per worker, after vLLM has given
the worker its device and rank, before the first step; the step's path is untouched. Where the
engine's workers span nodes under vLLM's own multi-node launch, rank 0 tells the other nodes'
workers the address, and they find it there (`sink_address.py`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from vllm_piep.config import PiepConfig
from vllm_piep.meters.worker_readings import RANK_ENV, SINK_ENV, ReadingSender
from vllm_piep.once import OnceLogger, logger
from vllm_piep.runtime.patching import Patch
from vllm_piep.runtime.worker import sink_address

_once = OnceLogger()
_senders: list[ReadingSender] = []  # this process's (one per worker it runs)


def _publish(parallel: Any, address: str | None) -> None:
    try:
        sink_address.publish(parallel, address)
    except Exception as exc:  # noqa: BLE001  (the other nodes' workers then do not meter)
        _once.warn("telling the other nodes' workers where to send their meter readings",
                   exc, "the workers on other nodes do not meter themselves")


def start_sender(worker: Any) -> ReadingSender | None:
    """This worker's meter thread, where the engine core exported a sink, or, on another node
    than the engine core's, where rank 0 says it did (else None)."""
    address: str | Callable[[], str | None] | None = os.environ.get(SINK_ENV) or None
    parallel = worker.vllm_config.parallel_config
    rank = int(worker.rank)
    if sink_address.across_nodes(parallel):
        if rank == 0:  # the engine core's node: its answer, for the others
            threading.Thread(target=_publish, args=(parallel, address), daemon=True,
                             name="piep-sink-address").start()
        elif address is None:  # a node of workers only: the answer, on the sender's thread
            address = partial(sink_address.resolve, parallel)
    if address is None:
        return None
    from vllm_piep.meters.factory import meter_factory

    config = PiepConfig.from_sources(worker.vllm_config.additional_config)
    os.environ[RANK_ENV] = str(rank)  # for a `module:callable` meter
    device = getattr(worker, "device", None)
    ordinal = getattr(device, "index", None) if getattr(device, "type", "") == "cuda" else None
    factory, label = meter_factory(config.meter or "auto",
                                   None if ordinal is None else [int(ordinal)],
                                   measuring_only=config.meter is None)
    where = f"cuda:{ordinal}" if ordinal is not None else "its host"

    def said(to: str) -> None:
        logger.info("vllm_piep: worker rank %d meters %s with %s for the engine core (%s)",
                    rank, where, label, to)

    sender = ReadingSender(address, rank, factory, on_address=said).start()
    _senders.append(sender)
    return sender


def _wrap_initialize_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_from_config(self: Any, kv_cache_config: Any) -> Any:
        result = original(self, kv_cache_config)
        try:
            start_sender(self)
        except Exception as exc:  # boundary: the engine core then settles by the fit
            _once.warn("starting this worker's meter", exc,
                       "the engine core settles the steps by the fit")
        return result

    return initialize_from_config


def patch() -> Patch:
    from vllm.v1.worker.gpu_worker import Worker

    return Patch(Worker, "initialize_from_config", _wrap_initialize_from_config,
                 why="a worker that meters its own devices (meter_scope) starts its meter once "
                     "it has its device and rank",
                 how="after the original: where the engine core exported its sink's address "
                     "(or, on another node under --nnodes, where rank 0 says it did), starts "
                     "the thread that reads this worker's meter and sends its readings",
                 until="vLLM offers a worker-started hook for plugins",
                 signature="(self, kv_cache_config)")
