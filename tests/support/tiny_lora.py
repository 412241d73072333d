"""A LoRA adapter for the tiny Llama, made here with random weights (PEFT's file layout: an
`adapter_config.json` and `adapter_model.safetensors`), for `vllm serve --enable-lora
--lora-modules NAME=PATH`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def build_lora(model_dir: Path, out: Path, rank: int = 4, seed: int = 0) -> Path:
    """The adapter in `out` (made once), on the q and v projections of every layer."""
    if (out / "adapter_model.safetensors").exists():
        return out
    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    widths = {"q_proj": config["num_attention_heads"] * head_dim,
              "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, width in widths.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = 0.01 * torch.randn(rank, hidden,
                                                                    generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(width, rank,
                                                                    generator=generator)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted(widths), "base_model_name_or_path": str(model_dir),
        "modules_to_save": None}))
    return out
