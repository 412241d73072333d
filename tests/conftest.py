"""Shared fixtures: the tiny model, real `vllm serve` processes (one per test module), and the
plugin's log records."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from support.paths import ROOT

# Property tests judge what a function returns, never how fast: hypothesis's per-example
# deadline and its "too slow to generate" check are wall-clock timings, which a loaded machine
# breaks at random. The suite tries the same examples in every run (`derandomize`: drawn from a
# seed made of each test's name), so a run passes or fails by the code alone;
# `HYPOTHESIS_PROFILE=explore` draws new ones each run, to look for cases the fixed ones miss
# (`scripts/flake-hunt.sh --explore`), each found case then kept as an `@example`.
settings.register_profile("suite", deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


class LogRecords(logging.Filter):
    """The records a logger handled, in order (a filter that keeps them and lets them pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return True

    def messages(self, at_least: int = logging.WARNING) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= at_least]


@pytest.fixture
def piep_logs() -> Iterator[LogRecords]:
    """The plugin's log records (INFO and up), kept by a filter on its own logger. vLLM
    (re)configures logging with `dictConfig` when it is first imported and when an engine's
    arguments name another logging configuration: its "vllm" logger stops propagating and every
    "vllm.*" logger, the plugin's included, loses its handlers and level, at a moment that
    depends on test order. A logger's filters survive that, and see every record it logs."""
    from vllm_piep.once import logger

    kept = LogRecords()
    level = logger.level
    logger.addFilter(kept)
    logger.setLevel(logging.INFO)
    try:
        yield kept
    finally:
        logger.removeFilter(kept)
        logger.setLevel(level)


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
