"""`scripts/gpu_power_curve.py` run dry, as CI can: the same sweeps on this CPU against the
stand-in `pynvml` of tests/support, so that the script works when a GPU is at hand. Every
point of its plan is measured in order and written as a row; the busy-share sweeps leave the
device idle for longer as the share falls; the plot says it is a dry run; bad input is one
line. The stand-in's watts say nothing of a GPU, and nothing here checks them."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT

SCRIPT = ROOT / "scripts" / "gpu_power_curve.py"


def _plan() -> list[tuple[str, int, float, float]]:
    spec = importlib.util.spec_from_file_location("gpu_power_curve", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module.plan()


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_a_dry_run_measures_every_point_of_the_plan_and_plots_them(tmp_path: Path) -> None:
    done = _run("--out", str(tmp_path), "--dry-run", "--window", "0.2")
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "power_curve.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    plan = _plan()
    assert [(r["sweep"], int(r["m"])) for r in rows] == [(s, m) for s, m, _, _ in plan]
    assert json.loads((tmp_path / "power_curve.json").read_text())["dry_run"] is True
    for row in rows:
        assert float(row["window_s"]) >= 0.2
        share = float(row["busy_share"])
        assert share == 0.0 if row["sweep"] == "idle" else 0.0 < share <= 1.0, row
    # Each busy-share sweep idles longer between its bursts as its share falls.
    for sweep in ("share, compute-bound", "share, memory-bound", "short gaps, memory-bound"):
        gaps = [float(r["gap_ms"]) for r in rows if r["sweep"] == sweep]
        assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[0] > 0.0, (sweep, gaps)
    png = tmp_path / "curve.png"
    plotted = _run("--plot", str(tmp_path / "power_curve.csv"), "--out", str(png))
    assert plotted.returncode == 0, plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_csv_to_plot_is_one_line(tmp_path: Path) -> None:
    done = _run("--plot", str(tmp_path / "gone.csv"), "--out", str(tmp_path / "x.png"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"gpu_power_curve: {tmp_path / 'gone.csv'}: no such file"]
