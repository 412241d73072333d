"""Engine core: `Executor.__init__` wrapped so that, where each worker meters its own GPUs
(`meter_scope`), the engine's sink for their readings (`meters/worker_readings.py`) is bound
before the executor starts its workers, and its address is in the environment they inherit
(multiprocessing workers) or are given (Ray copies the `PIEP_` variables).

The scope: `engine` reads the meter in the engine core (its node's GPUs); `worker` in every
worker, whatever its node; `auto` is `worker` on GPUs when some of the engine's workers run on
other nodes or its GPUs cannot be told from here (`engine_gpus.py`), else `engine`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from vllm_piep.config import PiepConfig
from vllm_piep.meters.worker_readings import SINK_ENV, ReadingSink
from vllm_piep.once import OnceLogger, logger
from vllm_piep.runtime.patching import Patch

# Where the executor keeps its sink (`measured_start.py` reads it).
SINK_ATTR = "_piep_worker_sink"

_once = OnceLogger()


def worker_scope(config: PiepConfig, parallel: Any, on_gpu: bool) -> bool:
    """Whether this engine's workers meter their own GPUs (module docstring)."""
    if not config.measured or config.meter_scope == "engine":
        return False
    if config.meter_scope == "worker":
        return True
    if not on_gpu:
        return False
    from vllm_piep.runtime.engine_core.engine_gpus import engine_gpus

    gpus = engine_gpus(parallel)
    return bool(gpus.elsewhere or gpus.unknown)


def open_sink(vllm_config: Any) -> ReadingSink | None:
    """The engine's sink where its workers are to meter themselves, its address exported."""
    from vllm_piep.runtime.vllm_config import device

    config = PiepConfig.from_sources(vllm_config.additional_config)
    parallel = vllm_config.parallel_config
    if not worker_scope(config, parallel, device()[0] == "cuda"):
        return None
    if int(getattr(parallel, "node_rank_within_dp", 0) or 0) > 0:
        # A node of workers only (`vllm serve --headless`): no engine core here to read a
        # sink; its workers send to the engine core's, whose address rank 0 gives them
        # (`runtime/worker/sink_address.py`).
        return None
    local = int(getattr(parallel, "local_world_size", parallel.world_size)
                or parallel.world_size)
    ray = "ray" in str(getattr(parallel, "distributed_executor_backend", "") or "")
    if local < int(parallel.world_size) or ray:  # workers elsewhere reach it over the network
        from vllm.utils.network_utils import get_ip

        host = get_ip()
    else:
        host = "127.0.0.1"
    sink = ReadingSink(host)
    os.environ[SINK_ENV] = sink.address
    logger.info("vllm_piep: each of the engine's %d workers meters its own devices and sends "
                "its readings to %s (meter_scope %s)", int(parallel.world_size),
                sink.address.partition("#")[0], config.meter_scope)
    return sink


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        try:
            setattr(self, SINK_ATTR, open_sink(vllm_config))
        except Exception as exc:  # boundary: the engine serves, in prediction mode at worst
            setattr(self, SINK_ATTR, None)
            _once.warn("opening the sink for the workers' meter readings", exc,
                       "the workers do not meter themselves")
        original(self, vllm_config, *args, **kwargs)

    return __init__


def patch() -> Patch:
    from vllm.v1.executor.abstract import Executor

    return Patch(Executor, "__init__", _wrap_init,
                 why="where workers meter their own GPUs (meter_scope), the engine's sink for "
                     "their readings must exist before the executor starts them",
                 how="before the original: binds the sink and puts its address in the "
                     "environment the workers inherit (none where the engine meters itself, "
                     "nor on a node of workers only)",
                 until="vLLM offers a hook to pass data from a plugin to the workers it starts")
