"""The GPUs an engine core's workers run on, found by vLLM's own rule, for the engine's meter.

vLLM 0.33 on CUDA and ROCm does not narrow `CUDA_VISIBLE_DEVICES` per data-parallel engine: a
worker's device is `ParallelConfig.get_local_gpu_index(local_rank)`, the local rank offset by
the engine's DP local rank times its world size (`config/parallel.py`); with Ray, where each
engine's visible devices are narrowed instead, or when one engine's workers span nodes, it is
the local rank itself. That index is a CUDA ordinal of the engine core's process (the workers
share its environment), unless `--device-ids` assigned the devices: then it indexes
`assigned_physical_gpu_ids`, physical (NVML) indices (`Worker.init_device`). This module calls
vLLM's function; it never copies it. A vLLM without it (0.32) gets ordinals 0..world-1, which
are the engine's GPUs only when it is the node's one engine: with several data-parallel engines
on a node the engine cannot tell its GPUs and says so (`unknown`).

An engine whose workers span nodes has `local_world_size` of them on its own node: the others'
GPUs cannot be metered from here, and the engine says so and stays in prediction mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineGpus:
    """This engine's GPUs on this node: CUDA ordinals of this process (`cuda`), or NVML
    indices (`nvml`, when vLLM was given `--device-ids`)."""

    kind: str  # "cuda" | "nvml"
    ids: tuple[int, ...]
    workers: int  # the engine's workers on every node
    rule: str  # how the ids were found, for the log
    unknown: str | None = None  # why the ids may not be the engine's (then nothing is metered)

    @property
    def elsewhere(self) -> int:
        """Workers on other nodes, whose GPUs this node cannot meter."""
        return self.workers - len(self.ids)

    def describe(self) -> str:
        names = ", ".join(f"{'cuda:' if self.kind == 'cuda' else 'nvml '}{i}" for i in self.ids)
        return f"{names} ({self.rule})"


def engine_gpus(parallel: Any) -> EngineGpus:
    """The GPUs of the engine whose `ParallelConfig` this is (its DP rank already set, as vLLM
    sets it in each engine-core process)."""
    world = int(parallel.world_size)
    local = int(getattr(parallel, "local_world_size", world) or world)
    index = getattr(parallel, "get_local_gpu_index", None)
    if callable(index):
        logical = [int(index(rank)) for rank in range(local)]
        dp = getattr(parallel, "data_parallel_rank_local", None)
        if dp is None:
            dp = getattr(parallel, "data_parallel_index", 0)
        rule = f"vLLM's get_local_gpu_index, DP local rank {dp}, world {world}"
    else:
        logical, rule = list(range(local)), "ranks 0..world-1 (this vLLM has no DP offset rule)"
    unknown = None
    engines_here = int(getattr(parallel, "data_parallel_size_local", 1) or 1)
    if not callable(index) and engines_here > 1:
        unknown = (f"this vLLM has no get_local_gpu_index: the node's {engines_here} "
                   "data-parallel engines' GPUs cannot be told apart")
    assigned = getattr(parallel, "assigned_physical_gpu_ids", None)
    if assigned:
        return EngineGpus("nvml", tuple(int(assigned[i]) for i in logical), world,
                          rule + ", through --device-ids", unknown)
    return EngineGpus("cuda", tuple(logical), world, rule, unknown)
