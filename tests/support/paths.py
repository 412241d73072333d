"""Where things are, for tests anywhere under tests/."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent  # the repository
SUPPORT = TESTS / "support"
PUBLISHED_DATA = ROOT / "data"  # the published datasets (data/README.md)
SHIPPED_BUNDLE = ROOT / "vllm_piep" / "bundles" / "cpu-tiny-llama"


def environ_with_tests(environ: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment whose PYTHONPATH starts with tests/ (so a subprocess imports
    `support`)."""
    import os

    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return env
