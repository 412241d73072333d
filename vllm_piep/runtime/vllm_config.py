"""What the plugin reads off vLLM's config, in every process."""

from __future__ import annotations

from typing import Any

from vllm_piep.model.flops import ModelShape


def model_shape(vllm_config: Any) -> ModelShape:
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return ModelShape.from_hf_config(
        model_config.hf_text_config.to_dict(),
        dtype_bytes=int(model_config.dtype.itemsize),
        tp=int(parallel.tensor_parallel_size),
        pp=int(parallel.pipeline_parallel_size),
        dp=int(parallel.data_parallel_size),
    )
