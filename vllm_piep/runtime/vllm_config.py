"""What the plugin reads off vLLM's config (and the environment vLLM reads with it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from vllm_piep.model.flops import ModelShape, ShapeError
from vllm_piep.once import OnceLogger, logger

# Config fields of the parts a dense decoder does not have: dropped to price the closest model.
_NON_DENSE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "kv_lora_rank",
                     "hybrid_override_pattern", "layers_block_type", "quantization_config")
_once = OnceLogger()


def model_shape(vllm_config: Any) -> ModelShape:
    """The model's shape for the prior. A config the shape cannot read (an unknown MoE naming,
    a missing field) is priced as the closest dense decoder, and the bundle id says why."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    dp = int(parallel.data_parallel_size)
    # vLLM's expert parallelism spans the tensor- and data-parallel ranks.
    ep = tp * dp if getattr(parallel, "enable_expert_parallel", False) else 1
    cfg = model_config.hf_text_config.to_dict()
    kw = dict(dtype_bytes=int(model_config.dtype.itemsize), tp=tp,
              pp=int(parallel.pipeline_parallel_size), dp=dp)
    try:
        return ModelShape.from_hf_config(cfg, ep=ep, **kw)
    except ShapeError as exc:
        dense = {k: v for k, v in cfg.items() if k not in _NON_DENSE_FIELDS}
        shape = ModelShape.from_hf_config(dense, **kw)
        note = f"{exc}: priced as a dense decoder"
        logger.warning("vllm_piep: %s", note)
        return replace(shape, notes=(*shape.notes, note))


def _cpu_ids(text: str) -> set[int]:
    """`5,2-4` -> {2, 3, 4, 5} (vLLM's CPU id lists)."""
    ids: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            first, last = part.split("-", 1)
            ids.update(range(int(first), int(last) + 1))
        elif part:
            ids.add(int(part))
    return ids


def engine_cpu_cores(vllm_config: Any, environ: Mapping[str, str] | None = None,
                     available: int | None = None) -> int:
    """The CPU cores this engine's ranks run on, for its share of the socket's static power:
    its ranks' lists in VLLM_CPU_OMP_THREADS_BIND (`|`-separated, data-parallel rank major, as
    vLLM reads them), else (`auto`, `nobind`) this host's cores shared equally by its local
    data-parallel engines."""
    env = os.environ if environ is None else environ
    parallel = vllm_config.parallel_config
    world = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
    local_engines = int(getattr(parallel, "data_parallel_size_local", None) or 1)
    local_rank = int(getattr(parallel, "data_parallel_rank_local", None) or 0)
    mask = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if mask not in ("", "auto", "nobind"):
        lists = mask.split("|")
        if local_engines == 1 and len(lists) > world:
            # A dense model's data-parallel engines run as independent engines, each told it
            # is DP rank 0 of 1; its real rank is `data_parallel_index`.
            local_rank = engine_index(vllm_config) % (len(lists) // world)
        mine = lists[local_rank * world:(local_rank + 1) * world]
        if len(mine) == world:
            return max(1, len(set().union(*(_cpu_ids(s) for s in mine))))
    if available is None:
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    return max(1, available // local_engines)


def engine_index(vllm_config: Any) -> int:
    """This engine's data-parallel rank (vLLM keeps it in `data_parallel_index` when it runs a
    dense model's DP ranks as independent engines, each with `data_parallel_rank` 0)."""
    parallel = vllm_config.parallel_config
    index = getattr(parallel, "data_parallel_index", None)
    return int(index if index is not None else getattr(parallel, "data_parallel_rank", 0) or 0)


def device(ordinal: int = 0) -> tuple[str, str | None]:
    """The platform's device type and the name of CUDA device `ordinal` (vLLM reads a GPU's
    name through NVML, or AMD SMI on ROCm, without initialising the device here). A name vLLM
    cannot read is None: a generic profile serves."""
    from vllm.platforms import current_platform

    device_type = str(current_platform.device_type)
    if device_type == "cpu":
        return device_type, None
    try:
        return device_type, str(current_platform.get_device_name(ordinal))
    except Exception as exc:  # noqa: BLE001  (NVML or AMD SMI missing or failing)
        _once.warn("reading the device name", exc, "a generic device profile prices energy")
        return device_type, None
