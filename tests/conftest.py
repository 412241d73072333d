"""Shared fixtures: the tiny model, and real `vllm serve` processes (one per test module)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from support.paths import ROOT

# Property tests judge what a function returns, never how fast: hypothesis's per-example
# deadline and its "too slow to generate" check are wall-clock timings, which a loaded machine
# breaks at random.
settings.register_profile("suite", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from vllm_piep.tools.tiny_model import build

    return build(Path(os.environ.get("PIEP_TINY_MODEL", ROOT / ".cache" / "tiny-llama")))


@pytest.fixture(scope="session")
def tiny_moe(tiny_model: Path) -> Path:
    """A tiny random Qwen3-MoE (8 experts, top-2) with the tiny Llama's tokenizer."""
    from vllm_piep.tools.tiny_model import build_moe

    return build_moe(ROOT / ".cache" / "tiny-qwen3-moe", tiny_model)


@pytest.fixture(scope="session")
def hf_llama(tiny_model: Path):
    """The tiny Llama in Hugging Face transformers with eager attention: its QK^T and PV are
    plain matmuls that torch's FLOP counter sees (the CPU SDPA kernel is not counted at all)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def shape(tiny_model: Path):
    """The tiny Llama's ModelShape (float32)."""
    import json

    from vllm_piep.model.flops import ModelShape

    return ModelShape.from_hf_config(json.loads((tiny_model / "config.json").read_text()),
                                     dtype_bytes=4)
