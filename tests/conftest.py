"""Shared fixtures: the tiny model, and real `vllm serve` processes (one per test module)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from vllm_piep.tiny_model import build

    return build(Path(os.environ.get("PIEP_TINY_MODEL", ROOT / ".cache" / "tiny-llama")))
