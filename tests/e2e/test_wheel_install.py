"""A serving-only install: the wheel, built by the documented command and installed in a
scratch virtual environment without vLLM and without the `calibrate` extra, pulls none of the
toolkit's dependencies, imports every serving module, finds the shipped bundle (package data,
not a source checkout's `models/`), and every command line's `--help` works there without
importing torch, vLLM or the toolkit's packages; a toolkit command that needs the extra says so
in one line, and the install line it gives resolves there, as does the documented
`pip install '.[calibrate]'` from the clone (pip's dry run: nothing installed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support.paths import ROOT

pytestmark = pytest.mark.server  # slow: builds and installs a wheel

# The wheel as README.md's Install block and docs/development.md build it (`-w dist` goes to a
# scratch folder here), and the toolkit as they install it from the clone.
WHEEL_BUILD = ("pip", "wheel", "--no-deps", "-w", "dist", ".")
TOOLKIT_INSTALL = "pip install '.[calibrate]'"
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


# Every command line and subcommand, as a user types it after `python -m`.
CLIS = [["vllm_piep.calibrate"], *[["vllm_piep.calibrate", c] for c in (
            "run", "finish", "whatif", "evaluate", "report", "train", "fit-prior",
            "validate-prior", "from-metrics")],
        ["vllm_piep.meters"], ["vllm_piep.meter"], ["vllm_piep.spans"], ["vllm_piep.spans", "show"],
        ["vllm_piep.spans", "tree"], ["kernels_trace"]]
# Runs a CLI as `python -m` would and prints, last, which heavy packages it imported.
HELP_PROBE = r"""
import json, runpy, sys
module, argv = sys.argv[1], sys.argv[2:]
sys.argv = [module, *argv]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = ("torch", "vllm", "sklearn", "scipy", "skl2onnx", "matplotlib", "pyarrow", "tqdm")
print(json.dumps({"code": code, "loaded": sorted(m for m in heavy if m in sys.modules)}))
"""


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch virtual environment with the built wheel installed, no extra: its python."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    dist = tmp_path / "dist"
    command = [str(dist) if word == "dist" else word for word in WHEEL_BUILD]
    build = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True,
                           cwd=ROOT, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("vllm_piep-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q",
                              "--disable-pip-version-check", str(wheel)],
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-3000:]
    return python


def calibrate_extra() -> set[str]:
    """The `calibrate` extra's distributions, as pyproject.toml declares them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {normal(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0])
            for r in project["optional-dependencies"]["calibrate"]}


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def would_install(python: Path, requirement: str, cwd: Path, tmp_path: Path) -> dict[str, dict]:
    """What `pip install REQUIREMENT` would install with `python` (pip's dry run and its JSON
    report), by distribution name."""
    report = tmp_path / "report.json"
    run = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "-q",
                          "--disable-pip-version-check", "--report", str(report), requirement],
                         capture_output=True, text=True, timeout=600, cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return {normal(item["metadata"]["name"]): item
            for item in json.loads(report.read_text())["install"]}


def test_the_documented_commands_are_the_ones_run_here() -> None:
    for doc in ("README.md", "docs/development.md"):
        text = (ROOT / doc).read_text()
        assert " ".join(WHEEL_BUILD) in text, f"{doc} builds the wheel otherwise"
    assert TOOLKIT_INSTALL in (ROOT / "README.md").read_text()


def test_the_toolkit_extra_resolves_from_the_clone(wheel_venv: Path, tmp_path: Path) -> None:
    requirement = TOOLKIT_INSTALL.removeprefix("pip install ").strip("'")
    found = would_install(wheel_venv, requirement, ROOT, tmp_path)
    assert calibrate_extra() <= set(found), sorted(found)
    assert found["vllm-piep"]["requested"] and found["vllm-piep"]["download_info"][
        "url"] == ROOT.as_uri()  # the clone itself


def test_the_wheel_serves_without_the_toolkit_and_finds_its_bundle(wheel_venv: Path,
                                                                   tmp_path: Path) -> None:
    python, venv = wheel_venv, wheel_venv.parents[1]
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


@pytest.mark.parametrize("cli", CLIS, ids=" ".join)
def test_every_help_works_on_the_base_install(wheel_venv: Path, tmp_path: Path,
                                             cli: list[str]) -> None:
    run = subprocess.run([str(wheel_venv), "-c", HELP_PROBE, *cli, "--help"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    *text, last = run.stdout.strip().splitlines()
    result = json.loads(last)
    assert result == {"code": 0, "loaded": []}, run.stderr[-3000:]
    assert "usage:" in "\n".join(text) and "--help" in "\n".join(text)


def test_a_toolkit_command_without_its_extra_says_which_in_one_line(wheel_venv: Path,
                                                                    tmp_path: Path) -> None:
    data = tmp_path / "device_1"
    data.mkdir()
    run = subprocess.run([str(wheel_venv), "-m", "vllm_piep.calibrate", "evaluate",
                          "--dataset", "irene", "--data", str(data), "--json",
                          str(tmp_path / "out.json")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    (line,) = run.stderr.strip().splitlines()
    given = re.search(r"pip install '([^']+)'", line)
    assert given and given.group(1) == "vllm-piep[calibrate]", line
    # The line works on this install: the installed wheel serves `vllm-piep` (no index has
    # it), the index the extra's packages.
    found = would_install(wheel_venv, given.group(1), tmp_path, tmp_path)
    assert calibrate_extra() <= set(found) and "vllm-piep" not in found, sorted(found)


def test_the_meter_measures_a_command_on_the_base_install(wheel_venv: Path,
                                                         tmp_path: Path) -> None:
    runs = tmp_path / "runs.csv"
    run = subprocess.run([str(wheel_venv), "-m", "vllm_piep.meter", "--meter", "simulated",
                          "--csv", str(runs), "--", str(wheel_venv), "-c", "print('hi')"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == "hi\n"
    header, row = runs.read_text().splitlines()
    assert header.startswith("start,end,seconds,joules") and ",simulated,simulated,0," in row
