"""Where things are, for tests anywhere under tests/."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent  # the repository
SUPPORT = TESTS / "support"
SHARED_DATA = ROOT.parent / "shared" / "data"  # ../shared beside the clone
SHIPPED_BUNDLE = ROOT / "vllm_piep" / "bundles" / "cpu-tiny-llama"
