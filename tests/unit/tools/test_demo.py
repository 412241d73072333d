"""The README's demo: what it says about the numbers and the model, and the setup it runs (no
download that only the tests use)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT, SHIPPED_BUNDLE

from vllm_piep.tools.demo import _calibrated_with, format_energy, is_random_weights

TINY_MODEL = Path(os.environ.get("PIEP_TINY_MODEL", ROOT / ".cache" / "tiny-llama"))


def usage(bundle: str, source: str) -> dict:
    breakdown = {"attention": 0.5, "static": 1.5}
    return {"prompt_tokens": 3, "completion_tokens": 4, "energy": {
        "joules": 2.0, "joules_per_output_token": 0.5, "prefill_joules": 0.5,
        "decode_joules": 1.5, "breakdown": breakdown, "bundle": bundle, "source": source}}


def test_a_shipped_bundle_is_said_to_match_by_the_device_name_alone() -> None:
    """The shipped bundle is picked by the CPU's model name: the demo names it and the meter,
    and never claims this is the hardware it was fitted on."""
    import json

    serving = json.loads((SHIPPED_BUNDLE / "manifest.json").read_text())["serving"]
    bundle_id = json.loads((SHIPPED_BUNDLE / "manifest.json").read_text())["bundle_id"]
    said = format_energy(usage(f"{bundle_id} (fit to cpu-estimate)", "estimated"))
    assert f"fitted to {serving['meter']}" in said
    assert f"a CPU whose model name is {serving['device_name']!r}" in said
    assert "not by the machine" in said and "this hardware" not in said
    assert _calibrated_with("no-such-bundle") == ""
    assert "not a measurement" in format_energy(usage("prior/cpu", "prior"))


def test_the_tiny_model_is_known_for_random_weights(tmp_path: Path) -> None:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (scripts/setup.sh builds it)")
    assert is_random_weights(str(TINY_MODEL))
    (tmp_path / "config.json").write_text("{}")
    assert not is_random_weights(str(tmp_path))


def test_the_demo_sets_up_without_the_test_downloads_and_the_tests_with_them() -> None:
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    test = (ROOT / "scripts" / "test.sh").read_text()
    assert 'scripts/setup.sh" --no-test-downloads' in demo
    assert "--no-test-downloads" not in test and 'scripts/setup.sh"' in test


@pytest.mark.slow
def test_setup_with_no_test_downloads_downloads_nothing_the_tests_use(tmp_path: Path) -> None:
    """scripts/setup.sh in a scratch checkout whose .venv is already set up (its stamp there,
    its python this one's): with --no-test-downloads it stops after the tiny model, with no
    vLLM 0.33.0 source and no Prometheus fetched; an unknown option exits 2."""
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (scripts/setup.sh builds it)")
    checkout = tmp_path / "clone"
    stamped = ("scripts/setup.sh", "pyproject.toml", "scripts/vllm_dist_shim.py",
               "scripts/gpu-wheels.txt")  # what setup.sh's stamp is made of, in its order
    for name in stamped:
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, checkout / name)
    inputs = b"".join((checkout / n).read_bytes() for n in stamped)
    venv_bin = checkout / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (checkout / ".venv" / f".piep-setup-{hashlib.sha256(inputs).hexdigest()[:16]}").touch()
    python = venv_bin / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    model = tmp_path / "tiny-llama"
    shutil.copytree(TINY_MODEL, model)
    env = dict(os.environ, PIEP_TINY_MODEL=str(model), PYTHONPATH=str(ROOT))
    setup = ["bash", str(checkout / "scripts" / "setup.sh")]
    done = subprocess.run([*setup, "--no-test-downloads"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "setup: reusing" in done.stdout and "--no-test-downloads" in done.stdout
    assert not (checkout / ".cache").exists()  # neither vllm033 nor prometheus
    refused = subprocess.run([*setup, "--no-such-option"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "unknown option" in refused.stderr
