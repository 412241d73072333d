"""Tiny configs of the model families the tree supports, served with `--load-format dummy`
(random weights from the config alone) and the tiny Llama's tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

_COMMON = {"vocab_size": 2048, "hidden_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "max_position_embeddings": 512, "torch_dtype": "float32",
           "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "intermediate_size": 256, "num_key_value_heads": 2, "rms_norm_eps": 1e-5},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "intermediate_size": 256, "num_key_value_heads": 2, "rms_norm_eps": 1e-6},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "intermediate_size": 256, "num_key_value_heads": 2, "head_dim": 32,
              "rms_norm_eps": 1e-6},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "intermediate_size": 256, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                "sliding_window": None},
    "opt": {"architectures": ["OPTForCausalLM"], "model_type": "opt", "ffn_dim": 256,
            "word_embed_proj_dim": 128, "do_layer_norm_before": True, "enable_bias": True,
            "activation_function": "relu", "layer_norm_elementwise_affine": True,
            "pad_token_id": 0},
}


def family_model(tokenizer_dir: Path, family: str, out: Path) -> Path:
    """A model directory for `family` with the tokenizer of `tokenizer_dir`."""
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps({**_COMMON, **FAMILIES[family]}, indent=1))
    return out
