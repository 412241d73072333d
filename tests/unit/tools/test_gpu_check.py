"""The GPU check (`scripts/gpu-check.sh`, `vllm_piep/tools/gpu_check/`) run dry, as CI can: every
section on this CPU against the stand-ins of tests/support (`standin_pynvml/pynvml.py`,
`fake_cuda`), so that the check works when a GPU is at hand. The stand-in GPU's faults check the
verdicts: a criterion that fails fails the run and the summary names it; no NVML, a MIG GPU and
a counter that never moves are one line each and the other sections run; a section past its
budget is stopped and keeps its figures."""

from __future__ import annotations

import json
import os
import re
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
    "step_clock": 8,  # 3 step lengths, disjoint, sum, pickling, host cost, no error
    "prior": 3,  # rows measured, finite, ratio (and the MAPE, reported)
    "measured": 7,
    "kernels": 4,
}

# Distributions imported here only because they are installed: the image's packages import
# them when present and run without them.
OPTIONAL_HERE = {"dill",  # torch.utils.data imports it when installed
                 "sniffio"}  # so does anyio, under transformers' hub client


def gpu_check(out: Path, *args: str, env: dict[str, str] | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


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
    text = SCRIPT.read_text()
    body = re.search(r"WHEEL_SPECS=\((.*?)\)", text, re.S)
    assert body, "scripts/gpu-check.sh lists no WHEEL_SPECS"
    return dict(spec.split("==") for spec in body.group(1).split())


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
    assert nvml["load"]["counter_watts"] == pytest.approx(100, rel=0.05)
    measured = found["measured"]["figures"]["energy"]
    assert measured["counter_delta_joules"] > 0 and measured["readings"] > 10
    rows = found["prior"]["figures"]["rows"]
    assert {r["model"] for r in rows} == {"llama-3.1-8b", "qwen3-30b-a3b"}
    assert len(rows) == 2 * 4 and all("error" not in r for r in rows)


@pytest.mark.slow
def test_a_failed_criterion_fails_the_run_and_the_summary_names_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = gpu_check(out, "--sections", "nvml", env={"PIEP_STANDIN_POWER_SKEW": "1.5"})
    assert done.returncode == 1, done.stdout[-2000:]
    summary = json.loads((out / SUMMARY_NAME).read_text())
    assert summary["failing_sections"] == ["nvml"] and not summary["passed"]
    failed = summary["sections"][0]["failed_criteria"]
    assert failed == ["counter watts agree with NVML's power samples under load"]
    assert "FAILED: nvml" in done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "expected"), [
    ({"PIEP_STANDIN_MISSING": "1"}, {"environment": ("skipped", "no NVML: nvmlInit failed"),
                                     "nvml": ("skipped", "no NVML: nvmlInit failed"),
                                     "step_clock": ("passed", None)}),
    ({"PIEP_STANDIN_MIG": "1"}, {"nvml": ("skipped", "MIG mode"),
                                 "step_clock": ("passed", None)}),
    ({"PIEP_STANDIN_FROZEN": "1"}, {"nvml": ("error", "the energy counter did not advance"),
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
