"""A serving-only install: the wheel, installed in a scratch virtual environment without vLLM
and without the `calibrate` extra, pulls none of the toolkit's dependencies, imports every
serving module, and finds the shipped bundle (package data, not a source checkout's
`models/`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT

pytestmark = pytest.mark.server  # slow: builds and installs a wheel

TOOLKIT = ["sklearn", "scipy", "skl2onnx", "matplotlib", "pyarrow", "tqdm", "vllm", "torch"]
PROBE = r"""
import importlib, importlib.util, json, pkgutil, sys
import vllm_piep
serving = ["vllm_piep.plugin", "vllm_piep.config"]
for package in ("vllm_piep.runtime", "vllm_piep.predict", "vllm_piep.model", "vllm_piep.meters"):
    module = importlib.import_module(package)
    serving += [m.name for m in pkgutil.walk_packages(module.__path__, package + ".")
                if not m.name.endswith("__main__")]
failed = {}
for name in serving:
    try:
        importlib.import_module(name)
    except Exception as exc:  # a serving module that needs what is not installed
        failed[name] = f"{type(exc).__name__}: {exc}"
from vllm_piep.predict.loader import shipped_bundles
from vllm_piep.model.devices import power_fits
print(json.dumps({
    "fits": sorted(power_fits()),
    "location": vllm_piep.__file__,
    "failed": failed,
    "imported": len(serving),
    "bundles": [str(b) for b in shipped_bundles()],
    "installed": sorted(m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None),
    "loaded": sorted(m for m in sys.argv[1:] if m in sys.modules),
}))
"""


def test_the_wheel_serves_without_the_toolkit_and_finds_its_bundle(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation",
                            "-q", "-w", str(dist), str(ROOT)], capture_output=True, text=True,
                           timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("vllm_piep-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q",
                              "--disable-pip-version-check", str(wheel)],
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-3000:]
    probe = subprocess.run([str(python), "-c", PROBE, *TOOLKIT], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert str(venv) in found["location"]  # the installed wheel, not this checkout
    # The worker's span recording needs torch, which every vLLM worker has; nothing else may
    # need more than the base install.
    assert {name for name, why in found["failed"].items()
            if not (name.startswith("vllm_piep.runtime.worker.") and "'torch'" in why)} == set()
    assert found["imported"] > 20
    assert found["installed"] == []  # no toolkit dependency, no vLLM, no torch came along
    (bundle,) = found["bundles"]
    assert bundle.endswith("vllm_piep/bundles/cpu-tiny-llama") and str(venv) in bundle
    assert (Path(bundle) / "manifest.json").is_file()
    assert found["fits"] == ["a100-sxm4-40gb", "h100-sxm5-80gb"]  # the prior's fit ships too
