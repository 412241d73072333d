"""The GPU check (`scripts/gpu-check.sh`, `vllm_piep/tools/gpu_check/`) run dry, as CI can: every
section on this CPU against the stand-ins of tests/support (`standin_pynvml/pynvml.py`,
`fake_cuda`), so that the check works when a GPU is at hand. The stand-in GPU's faults check the
verdicts: a criterion that fails fails the run and the summary names it; no NVML, a MIG GPU and
a counter that never moves are one line each and the other sections run; a section past its
budget is stopped and keeps its figures. The script picks its interpreter ($PYTHON, else the
checkout's .venv, else python3), says which, and fetches wheels for that interpreter's version:
checked on a copy of the script with stand-in interpreters that log how they are called."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from support.paths import ROOT

from vllm_piep.tools.gpu_check.prior_section import nnls3
from vllm_piep.tools.gpu_check.runner import LOG_NAME, SECTIONS, SUMMARY_NAME

SCRIPT = ROOT / "scripts" / "gpu-check.sh"
# Each section's criteria: the dry run must evaluate every one (a criterion that stops being
# evaluated is a check that rotted).
CRITERIA = {
    "environment": 2,
    "nvml": 16,  # UUID found, 5 mapping routes, PCI, counter, period, profile, 3 generic
    #              figures, load, idle, the meter command
    # disjoint, sum, pickling, no error (host cost: reported; the 3 step lengths against wall
    # time: reported in a dry run, whose simulated device runs in this shared CPU's time)
    "step_clock": 4,
    "prior": 3,  # rows measured, finite, ratio (and the MAPE, reported)
    "measured": 7,
    "kernels": 4,
}

# Distributions imported here only because they are installed: the image's packages import
# them when present and run without them.
OPTIONAL_HERE = {"dill",  # torch.utils.data imports it when installed
                 "sniffio"}  # so does anyio, under transformers' hub client


def gpu_check(out: Path, *args: str, env: dict[str, str] | None = None,
              timeout: float = 600, python: str | None = sys.executable
              ) -> subprocess.CompletedProcess[str]:
    """The dry run with PYTHON=`python` (None: PYTHON unset)."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**base, **({"PYTHON": python} if python else {}), **(env or {})})


def sections(out: Path) -> dict[str, dict]:
    return {s.name: json.loads((out / f"{s.name}.json").read_text())
            for s in SECTIONS if (out / f"{s.name}.json").is_file()}


def carried_and_present() -> set[str]:
    """The distributions the GPU machine has: its image's, and the wheels the script
    carries."""
    text = (ROOT / "scripts" / "gpu-image-packages.txt").read_text()
    image = {w for line in text.splitlines() if not line.startswith("#") for w in line.split()}
    return image | set(wheel_specs())


def wheel_specs() -> dict[str, str]:
    """scripts/gpu-wheels.txt: what scripts/gpu-check.sh carries and setup.sh pins."""
    text = (ROOT / "scripts" / "gpu-wheels.txt").read_text()
    specs = dict(line.strip().split("==") for line in text.splitlines()
                 if line.strip() and not line.startswith("#"))
    assert specs, "scripts/gpu-wheels.txt lists no wheels"
    return specs


def requirements_of(names: set[str]) -> set[str]:
    """What these installed distributions require, transitively (the image's own packages
    bring their requirements, whatever their versions here require)."""
    found: set[str] = set()
    todo = list(names)
    while todo:
        try:
            requires = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue
        for r in requires:
            if "extra ==" in r:
                continue
            name = normal(re.split(r"[<>=!~\[; (]", r, maxsplit=1)[0])
            if name not in found:
                found.add(name)
                todo.append(name)
    return found


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.slow
def test_the_dry_run_runs_every_section_and_every_criterion(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = gpu_check(out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and SUMMARY_NAME in files and LOG_NAME in files, files
    found = sections(out)
    assert list(found) == [s.name for s in SECTIONS]
    for name, data in found.items():
        assert data["status"] == "passed" and data["complete"] and data["dry_run"], (name, data)
        gated = [c for c in data["criteria"] if c["passed"] is not None]
        assert len(gated) == CRITERIA[name], (name, [c["name"] for c in gated])
        assert all("not gated in a dry run: " in c["target"] for c in data["criteria"]
                   if "wall time" in c["name"]), name
        assert all(c["passed"] is True and c["target"] for c in gated), name
        # No vLLM, and nothing the GPU machine lacks (the check runs there without network).
        owners = [{normal(d) for d in dists}
                  for dists in data["imported_distributions"].values()]
        imported = set().union(*owners)
        assert not {d for d in imported if d.startswith("vllm") and d != "vllm-piep"}, name
        present = {normal(d) for d in carried_and_present()}
        allowed = (present | requirements_of(imported & present) | {"vllm-piep"}
                   | OPTIONAL_HERE)
        missing = [dists for dists in owners if not dists & allowed]
        assert not missing, (name, missing)
    summary = json.loads((out / SUMMARY_NAME).read_text())
    assert summary["passed"] and summary["dry_run"] and not summary["failing_sections"]
    assert [s["section"] for s in summary["sections"]] == [s.name for s in SECTIONS]
    # The summary table is printed last, saying what the figures are.
    tail = done.stdout.strip().splitlines()[-14:]
    assert "DRY RUN" in "\n".join(tail) and "no section failed" in tail[-1]
    # The figures are the stand-in's, checked where the stand-in fixes them.
    nvml = found["nvml"]["figures"]
    assert nvml["counter_update_period_s"] == pytest.approx(0.04, rel=0.5)
    assert nvml["load"]["counter_watts"] == pytest.approx(80, rel=0.05)
    measured = found["measured"]["figures"]["energy"]
    assert measured["counter_delta_joules"] > 0 and measured["readings"] > 10
    rows = found["prior"]["figures"]["rows"]
    assert {r["model"] for r in rows} == {"llama-3.1-8b", "qwen3-30b-a3b"}
    assert len(rows) == 2 * 4 and all("error" not in r for r in rows)


@pytest.mark.slow
def test_a_failed_criterion_fails_the_run_and_the_summary_names_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = gpu_check(out, "--sections", "nvml", env={"STANDIN_POWER_SKEW": "1.5"})
    assert done.returncode == 1, done.stdout[-2000:]
    summary = json.loads((out / SUMMARY_NAME).read_text())
    assert summary["failing_sections"] == ["nvml"] and not summary["passed"]
    failed = summary["sections"][0]["failed_criteria"]
    assert failed == ["counter watts agree with NVML's power samples under load"]
    assert "FAILED: nvml" in done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "expected"), [
    ({"STANDIN_MISSING": "1"}, {"environment": ("skipped", "no NVML: nvmlInit failed"),
                                     "nvml": ("skipped", "no NVML: nvmlInit failed"),
                                     "step_clock": ("passed", None)}),
    ({"STANDIN_MIG": "1"}, {"nvml": ("skipped", "MIG mode"),
                                 "step_clock": ("passed", None)}),
    ({"STANDIN_FROZEN": "1"}, {"nvml": ("error", "the energy counter did not advance"),
                                    "step_clock": ("passed", None)}),
])
def test_a_section_that_cannot_run_says_so_in_one_line_and_the_next_runs(
        tmp_path: Path, fault: dict[str, str], expected: dict[str, tuple[str, str | None]]
        ) -> None:
    out = tmp_path / "out"
    done = gpu_check(out, "--sections", ",".join(expected), env=fault)
    found = sections(out)
    for name, (status, reason) in expected.items():
        assert found[name]["status"] == status, (name, found[name])
        if reason is not None:
            assert reason in found[name]["reason"] and "\n" not in found[name]["reason"]
    failing = any(status in ("failed", "error") for status, _ in expected.values())
    assert done.returncode == (1 if failing else 0), done.stdout[-2000:]


@pytest.mark.slow
def test_a_section_past_its_budget_is_stopped_and_keeps_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # The section takes ~24 s here and writes its first figure within a few seconds, which a
    # loaded machine can stretch: half its time leaves room both ways.
    done = gpu_check(out, "--sections", "prior,environment", "--budget", "prior=12")
    assert done.returncode == 1
    prior = sections(out)["prior"]
    assert prior["status"] == "timeout" and "budget" in prior["reason"]
    assert not prior["complete"] and prior["figures"]  # what it had written
    assert sections(out)["environment"]["status"] == "passed"  # the next one ran


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    done = gpu_check(tmp_path / "out", "--sections", "nvml,bogus")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "unknown section(s) ['bogus']" in done.stderr
    done = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHON": sys.executable},
                          timeout=60) if not (ROOT / ".whl").is_dir() else None
    if done is not None:  # without carried wheels, the real run says how to make them
        assert done.returncode == 2 and "--fetch-wheels" in done.stderr


def test_the_carried_wheels_are_what_the_gpu_image_lacks_at_the_versions_tested() -> None:
    """Every base dependency of the package, and theirs, is in the image or carried; each
    carried wheel is the version this suite runs with."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    present = {normal(d) for d in carried_and_present()}
    todo = [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in project["dependencies"]]
    seen: set[str] = set()
    while todo:
        name = normal(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        assert name in present, f"{name} is neither in the GPU image nor carried"
        if name in {normal(w) for w in wheel_specs()}:
            todo += [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]
                     for r in metadata.requires(name) or []
                     if "extra ==" not in r and "python_version >= '3.13'" not in r]
    for name, version in wheel_specs().items():
        assert metadata.version(name) == version, name


def test_the_three_power_fit_is_non_negative_least_squares() -> None:
    from scipy.optimize import nnls

    rng = np.random.default_rng(7)
    for _ in range(100):
        a, b = rng.normal(size=(12, 3)), rng.normal(size=12)
        assert nnls3(a, b) == pytest.approx(nnls(a, b)[0], abs=1e-9)


# A stand-in interpreter: answers the script's probe (`-c`: "VERSION HAS_TORCH") and logs every
# other call, by its own path, to $STUB_LOG.
STUB_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then echo "${STUB_FACTS:-3.12 1}"; exit 0; fi
echo "$0 $*" >> "$STUB_LOG"
"""
# A python3 without torch: what a system interpreter answers to the check.
PYTHON3_WITHOUT_TORCH = """#!/usr/bin/env bash
echo "ModuleNotFoundError: No module named 'torch'" >&2
exit 1
"""


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def checkout_copy(tmp_path: Path, venv: bool = True) -> Path:
    """The script in a checkout of its own (with or without a stand-in .venv): its root."""
    root = tmp_path / "checkout"
    executable(root / "scripts" / "gpu-check.sh", SCRIPT.read_text())
    shutil.copy(ROOT / "scripts" / "gpu-wheels.txt", root / "scripts" / "gpu-wheels.txt")
    if venv:
        executable(root / ".venv" / "bin" / "python", STUB_PYTHON)
    return root


def run_copy(root: Path, *args: str, facts: str = "3.12 1", python: Path | None = None,
             python3: str = STUB_PYTHON) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The copied script run with PYTHON=`python` (None: unset) and a PATH whose first python3
    is `python3`; its result and the stand-in interpreters' calls."""
    bin_dir = executable(root.parent / "bin" / "python3", python3).parent
    log = root.parent / "calls.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", STUB_LOG=str(log), STUB_FACTS=facts)
    if python is not None:
        env["PYTHON"] = str(python)
    done = subprocess.run(["bash", str(root / "scripts" / "gpu-check.sh"), *args],
                          capture_output=True, text=True, timeout=60, cwd=root.parent, env=env)
    return done, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize(("python", "venv", "chosen", "why"), [
    ("elsewhere/python", True, "elsewhere/python", "(PYTHON is set)"),
    (None, True, "checkout/.venv/bin/python", "(the checkout's .venv)"),
    (None, False, "bin/python3", "(python3 on PATH: the checkout has no .venv)"),
], ids=["PYTHON", ".venv", "python3"])
def test_the_interpreter_is_python_then_the_venv_then_python3_and_said(
        tmp_path: Path, python: str | None, venv: bool, chosen: str, why: str) -> None:
    root = checkout_copy(tmp_path, venv=venv)
    given = executable(tmp_path / python, STUB_PYTHON) if python else None
    done, calls = run_copy(root, "--dry-run", "--out", "o", python=given)
    assert done.returncode == 0, done.stderr
    path = str(tmp_path / chosen)
    assert done.stdout.splitlines()[0] == f"gpu-check: python {path}, 3.12 {why}"
    assert calls == [f"{path} {root}/scripts/gpu_check.py --dry-run --out o"]


@pytest.mark.parametrize(("args", "target"), [
    ((), "3.12"), (("--python-version", "3.11"), "3.11"), (("--python-version=3.13",), "3.13"),
], ids=["the interpreter's", "given", "given="])
def test_the_wheels_are_fetched_for_the_interpreter_s_version_unless_told(
        tmp_path: Path, args: tuple[str, ...], target: str) -> None:
    root = checkout_copy(tmp_path)
    done, calls = run_copy(root, "--fetch-wheels", *args, facts="3.12 1")
    assert done.returncode == 0, done.stderr
    download, check = calls
    for pip in (download, check):  # both the download and the install check
        words = pip.split()
        assert words[words.index("--python-version") + 1] == target, pip
    assert download.split()[1:4] == ["-m", "pip", "-q"] and "download" in download
    assert f"wheels for CPython {target}" in done.stdout.splitlines()[-1]


@pytest.mark.parametrize(("args", "facts", "named"), [
    (("--fetch-wheels", "--python-version", "3.10"), "3.12 1", "--python-version 3.10"),
    (("--fetch-wheels", "--python-version", "three"), "3.12 1", "--python-version three"),
    (("--fetch-wheels", "--python-version"), "3.12 1", "--python-version: expected X.Y"),
    (("--fetch-wheels", "--out", "o"), "3.12 1", "--out"),
    (("--dry-run",), "3.10 1", "Python 3.10; the package needs 3.11 or newer"),
    (("--dry-run",), "3.12 0", "has no torch"),
    (("--out", "o"), "3.11 1", "are for CPython 3.12, "),
], ids=["too old", "not a version", "no version", "another option", "old interpreter",
        "no torch", "wheels for another Python"])
def test_what_cannot_run_is_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...],
                                                facts: str, named: str) -> None:
    root = checkout_copy(tmp_path)
    executable(root / ".whl" / "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl", "")
    done, calls = run_copy(root, *args, facts=facts)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("gpu-check: ") and named in line, line
    assert calls == []  # nothing ran: no pip, no check


def test_the_oldest_python_is_pyproject_s() -> None:
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert f'MIN_PYTHON={requires.removeprefix(">=")} ' in SCRIPT.read_text()


@pytest.mark.slow
def test_the_documented_dry_run_takes_the_checkout_s_venv_over_a_python3_without_torch(
        tmp_path: Path) -> None:
    """`bash scripts/gpu-check.sh --dry-run` as docs/gpu-validation.md writes it: no PYTHON,
    a python3 on PATH without torch, the .venv that scripts/setup.sh makes."""
    venv_python = ROOT / ".venv" / "bin" / "python"
    if not os.access(venv_python, os.X_OK):
        pytest.skip(f"no {venv_python}: bash scripts/setup.sh makes it")
    bin_dir = executable(tmp_path / "bin" / "python3", PYTHON3_WITHOUT_TORCH).parent
    out = tmp_path / "out"
    done = gpu_check(out, "--sections", "environment", python=None,
                     env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.splitlines()[0].startswith(f"gpu-check: python {venv_python}, ")
    assert done.stdout.splitlines()[0].endswith(" (the checkout's .venv)")
    assert sections(out)["environment"]["status"] == "passed"
