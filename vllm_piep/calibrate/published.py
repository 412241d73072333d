"""Published vLLM deployments (ML.ENERGY leaderboard v2 on A100, v3 on H100) as the serve path
would price them: one `Deployment` per row, with the `ModelShape` the engine would build from
the model's config (`model_structures.csv`, read through `ModelShape.from_hf_config`) and the
step the engine would see on average.

The average step: each engine runs `avg batch / engines` decode requests whose context is the
prompt plus half the output, and the prompt tokens of the requests that start in that step (one
prefill row: `prompt x batch / output` tokens); the step lasts `batch / throughput` seconds (the
measured mean inter-token latency, which includes prefill time). Prompt lengths are not in
either table: `PROMPT_TOKENS` assumes one per task. The engine does not run that average step:
some of its steps carry whole prompts and the rest decode alone (`engine_steps`); a term that
saturates (the prior's occupancy) is priced on those.

The v3 table's deployments with expert parallelism (`expert_parallel` > 1, `tensor_parallel` 1)
run as one engine over all their GPUs (their mean batch equals `max_num_seqs` and batch /
throughput equals the measured inter-token latency): attention across `num_gpus` ranks, experts
across `expert_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vllm_piep.datasets.model import DatasetError, read_csv_table
from vllm_piep.model.flops import ModelShape, ShapeError, StepBatch
from vllm_piep.model.shape import weight_bytes_of_precision

# GPU names as NVML reports them (what the engine would match a profile on).
GPU_NAMES = {"H100": "NVIDIA H100 80GB HBM3", "A100": "NVIDIA A100-SXM4-40GB"}

# Assumed mean prompt tokens per task (neither table has them). Text tasks: typical lengths of
# the prompt sets the leaderboards name (LMArena conversations, GPQA questions with their
# choices, ShareGPT-style chat, HumanEval-style code); multimodal tasks add the images' tokens
# (LLaVA-1.5: 576 per image; Qwen-VL-style dynamic resolution: ~1000 per image, video several
# frames of them).
PROMPT_TOKENS: dict[str, float] = {
    "lm-arena-chat": 300.0, "gpqa": 250.0, "sourcegraph-fim": 1500.0,
    "image-chat": 1200.0, "video-chat": 6000.0,
    "llm_text_generation/chat": 250.0, "llm_text_generation/code": 150.0,
    "mllm_text_generation/chat": 650.0,
}
DEFAULT_PROMPT_TOKENS = 300.0

# HF architecture class -> model_type (what `from_hf_config` reads).
MODEL_TYPES: dict[str, str] = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
    "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v3", "Llama4ForConditionalGeneration": "llama4_text",
    "NemotronHForCausalLM": "nemotron_h", "Starcoder2ForCausalLM": "starcoder2",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe_text",
    "Qwen3OmniMoeForConditionalGeneration": "qwen3_omni_moe_text",
}

# What a config says that `model_structures.csv` has no column for, from that table's README
# (`data/model_structures.README.md` in the repository, conventions and per-row notes).
_DEEPSEEK = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
             "qk_nope_head_dim": 128, "v_head_dim": 128, "first_k_dense_replace": 3,
             "intermediate_size": 18432, "n_shared_experts": 1}
_NEMOTRON = {"mamba_num_heads": 128, "mamba_head_dim": 80, "n_groups": 8, "ssm_state_size": 128,
             "conv_kernel": 4, "hidden_act": "relu2"}
# Block counts (M: Mamba-2, *: attention, -: MLP); the order does not change the work's sum.
_9B, _12B = "M" * 27 + "*" * 4 + "-" * 25, "M" * 28 + "*" * 6 + "-" * 28
CONFIG_EXTRAS: dict[str, dict[str, Any]] = {
    "deepseek-ai/DeepSeek-V3.1": _DEEPSEEK,
    "deepseek-ai/DeepSeek-R1-0528": _DEEPSEEK,
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8": {"interleave_moe_layer_step": 2,
                                                         "intermediate_size_mlp": 16384},
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": {"interleave_moe_layer_step": 1},
    "nvidia/NVIDIA-Nemotron-Nano-9B-v2": {**_NEMOTRON, "hybrid_override_pattern": _9B},
    "nvidia/NVIDIA-Nemotron-Nano-12B-v2": {**_NEMOTRON, "hybrid_override_pattern": _12B},
    "nvidia/NVIDIA-Nemotron-Nano-12B-v2-VL-BF16": {**_NEMOTRON, "hybrid_override_pattern": _12B},
}

V2_COLUMNS = ("task", "Model", "GPU", "TP", "PP", "Energy/req (J)", "Token tput (tok/s)",
              "Avg Output Tokens", "Avg BS (reqs)")
V3_COLUMNS = ("model_id", "gpu_model", "task", "architecture", "avg_batch_size", "avg_output_len",
              "energy_per_token_joules", "output_throughput_tokens_per_sec", "num_gpus",
              "tensor_parallel", "expert_parallel", "data_parallel", "weight_precision")
STRUCTURE_COLUMNS = ("model_id", "architecture", "num_hidden_layers", "hidden_size",
                     "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size")


@dataclass(frozen=True)
class Deployment:
    """One published configuration, as the engine would see it."""

    model: str
    task: str
    gpu: str  # as NVML names it
    kind: str  # dense, moe, hybrid
    shape: ModelShape  # one engine's
    engines: int
    batch: float  # mean running requests, all engines
    output_tokens: float
    prompt_tokens: float
    tokens_per_s: float
    joules_per_token: float  # measured
    line: int
    max_batch: float = 0.0  # the engine's request limit (max_num_seqs); 0: not published

    @property
    def step_seconds(self) -> float:
        return self.batch / self.tokens_per_s

    @property
    def devices(self) -> int:
        return self.engines * self.shape.tp * self.shape.pp

    def engine_steps(self) -> list[tuple[float, StepBatch]]:
        """The steps one engine alternates between, each with the share of steps it is:
        with r = (batch / engines) / output prompts starting per step, a share min(r, 1) of the
        steps carries max(r, 1) prompts' tokens beside the decodes and the rest decode alone.
        Weighted, their tokens, context and sampled rows are the average step's (module
        docstring); a prompt attends to all of itself, as the engine computes it."""
        per_engine = self.batch / self.engines
        decode = [(0, 1, self.prompt_tokens + self.output_tokens / 2, 1)] * max(
            1, int(round(per_engine)))
        starting = per_engine / self.output_tokens
        with_prompts = StepBatch.from_rows(
            decode + [(self.prompt_tokens * max(starting, 1.0), 0, 0, 0)])
        if starting >= 1.0:
            return [(1.0, with_prompts)]
        return [(starting, with_prompts), (1.0 - starting, StepBatch.from_rows(decode))]


def dataset_version(columns: pd.Index) -> str:
    """'v3' or 'v2' by the columns a leaderboard export has; one line naming what is missing."""
    if "energy_per_token_joules" in columns:
        missing = [c for c in V3_COLUMNS if c not in columns]
        version = "v3"
    else:
        missing = [c for c in V2_COLUMNS if c not in columns]
        version = "v2"
    if missing:
        raise DatasetError(f"missing columns {missing} for an ML.ENERGY {version} table")
    return version


def _structures(path: Path) -> dict[str, dict[str, Any]]:
    table = read_csv_table(path)
    missing = [c for c in STRUCTURE_COLUMNS if c not in table.columns]
    if missing:
        raise DatasetError(f"{path}:1: missing columns {missing}")
    return {str(r["model_id"]): r for r in table.to_dict("records")}


def hf_config(row: dict[str, Any], precision: str = "bfloat16") -> dict[str, Any]:
    """A Hugging Face config dict for a `model_structures.csv` row (plus `CONFIG_EXTRAS`)."""
    arch = str(row["architecture"])
    cfg: dict[str, Any] = {
        "model_type": MODEL_TYPES.get(arch, "llama"), "hidden_size": row["hidden_size"],
        "num_hidden_layers": row["num_hidden_layers"],
        "num_attention_heads": row["num_attention_heads"],
        "num_key_value_heads": row["num_key_value_heads"], "head_dim": row["head_dim"],
        "vocab_size": row["vocab_size"], "intermediate_size": row["intermediate_size"],
    }
    experts = row.get("num_experts")
    if experts and np.isfinite(experts) and experts > 0:
        cfg.update(num_experts=int(experts), num_experts_per_tok=int(row["num_experts_per_tok"]),
                   moe_intermediate_size=int(row["moe_intermediate_size"]))
        shared = row.get("shared_expert_intermediate_size")
        if shared and np.isfinite(shared):
            cfg["shared_expert_intermediate_size"] = int(shared)
    cfg.update(CONFIG_EXTRAS.get(str(row["model_id"]), {}))
    wb = weight_bytes_of_precision(precision)
    if wb < 2:
        cfg["quantization_config"] = {"quant_method": precision.strip().lower()}
    return {k: (int(v) if isinstance(v, float) and v.is_integer() else v) for k, v in cfg.items()}


def _num(value: object, name: str, line: int, path: Path) -> float:
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        out = float("nan")
    if not np.isfinite(out) or out <= 0:
        raise DatasetError(f"{name} is {value!r}, expected a positive number")
    return out


def load_deployments(data: str | Path, structures: str | Path
                     ) -> tuple[list[Deployment], list[str]]:
    """Every row the engine could price, and one line per row it could not (with why)."""
    path, struct_path = Path(data), Path(structures)
    table = read_csv_table(path)
    try:
        version = dataset_version(table.columns)
    except DatasetError as exc:
        raise DatasetError(f"{path}:1: {exc}") from None
    structs = _structures(struct_path)
    out: list[Deployment] = []
    skipped: list[str] = []
    for i, r in enumerate(table.to_dict("records")):
        line = i + 2
        try:
            out.append(_deployment(r, version, structs, line, path))
        except (DatasetError, ShapeError, ValueError) as exc:
            skipped.append(f"{path}:{line}: {exc}")
    return out, skipped


def _deployment(r: dict[str, Any], version: str, structs: dict[str, dict[str, Any]],
                line: int, path: Path) -> Deployment:
    if version == "v3":
        model, task = str(r["model_id"]), str(r["task"])
        gpu = GPU_NAMES.get(str(r["gpu_model"]), str(r["gpu_model"]))
        gpus = int(_num(r["num_gpus"], "num_gpus", line, path))
        tp = int(_num(r["tensor_parallel"], "tensor_parallel", line, path))
        ep = int(_num(r["expert_parallel"], "expert_parallel", line, path))
        dp = int(_num(r["data_parallel"], "data_parallel", line, path))
        if ep > 1 and tp == 1:
            tp, engines = gpus // dp, dp  # one engine over its GPUs (module docstring)
        else:
            engines = max(1, gpus // tp)
        precision = str(r["weight_precision"])
        batch = _num(r["avg_batch_size"], "avg_batch_size", line, path)
        out_len = _num(r["avg_output_len"], "avg_output_len", line, path)
        tput = _num(r["output_throughput_tokens_per_sec"], "output_throughput_tokens_per_sec",
                    line, path)
        jpt = _num(r["energy_per_token_joules"], "energy_per_token_joules", line, path)
        limit = r.get("max_num_seqs", 0.0)
        pp = 1
    else:
        model, task = str(r["Model"]), str(r["task"])
        gpu = GPU_NAMES.get(str(r["GPU"]), str(r["GPU"]))
        tp = int(_num(r["TP"], "TP", line, path))
        pp = int(_num(r["PP"], "PP", line, path))
        ep, engines, precision = 1, 1, "bfloat16"
        batch = _num(r["Avg BS (reqs)"], "Avg BS (reqs)", line, path)
        out_len = _num(r["Avg Output Tokens"], "Avg Output Tokens", line, path)
        tput = _num(r["Token tput (tok/s)"], "Token tput (tok/s)", line, path)
        jpt = _num(r["Energy/req (J)"], "Energy/req (J)", line, path) / out_len
        limit = r.get("Max BS (reqs)", 0.0)
    if model not in structs:
        raise DatasetError(f"model {model!r} is not in the structure table")
    shape = ModelShape.from_hf_config(hf_config(structs[model], precision), dtype_bytes=2,
                                      tp=tp, pp=pp, dp=engines, ep=ep)
    return Deployment(model=model, task=task, gpu=gpu, kind=shape.kind, shape=shape,
                      engines=engines, batch=batch, output_tokens=out_len,
                      prompt_tokens=PROMPT_TOKENS.get(task, DEFAULT_PROMPT_TOKENS),
                      tokens_per_s=tput, joules_per_token=jpt, line=line,
                      max_batch=_limit(limit))


def _limit(value: object) -> float:
    """A published request limit, 0 where the row has none."""
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return out if np.isfinite(out) and out > 0 else 0.0
