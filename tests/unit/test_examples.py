"""`examples/README.md`'s commands, run as a user would from a checkout, on a scratch copy of
`examples/`: each exits 0 and writes what it says."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT

EXAMPLES = ROOT / "examples"


def commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (EXAMPLES / "README.md").read_text(), re.S)
    assert block, "examples/README.md has no bash block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines()
            if line.strip()]


def test_the_readme_names_every_example() -> None:
    text = (EXAMPLES / "README.md").read_text()
    for path in ("spans/", "traces/rank0.json.gz", "traces/single-process.json.gz",
                 "campaign/"):
        assert f"`{path}" in text and (EXAMPLES / path).exists(), path


def assert_sources_under(campaign: Path) -> None:
    """Every row's span file is named relative to the campaign directory, and is there."""
    import pandas as pd

    sources = set(pd.read_parquet(campaign / "dataset" / "nodes.parquet").source) - {""}
    assert sources
    for source in sources:
        assert not Path(source).is_absolute() and (campaign / source).is_file(), source


def test_the_example_dataset_names_its_span_files_within_the_campaign() -> None:
    assert_sources_under(EXAMPLES / "campaign")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("examples")
    shutil.copytree(EXAMPLES, work / "examples")
    return work


@pytest.mark.slow
@pytest.mark.parametrize("command", commands())
def test_every_command_runs(workdir: Path, command: str) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(ROOT), COLUMNS="160")
    proc = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "kernels_trace" in command:
        out = json.loads((workdir / command.split("--json ")[1].split()[0]).read_text())
        assert out["steps"] and out["modules"]
        if "rank1" in command:  # two ranks of a TP 2 server: its all-reduces, matched
            assert {c["rank"] for c in out["collectives"]} == {0, 1}
            assert all(c["wait_ns"] >= 0 and c["transfer_ns"] >= 0 for c in out["collectives"])
    if "spans show" in command:
        assert "all_reduce" in proc.stdout and "layers.0.mlp" in proc.stdout
    if "calibrate finish" in command:
        page = (workdir / "my-campaign" / "report" / "index.html").read_text()
        for protocol in ("kfold", "leave-one-batch-out", "leave-one-tp-out"):
            assert f"href='{protocol}/index.html'" in page
            assert (workdir / "my-campaign" / "report" / protocol / "index.html").is_file()
        # The campaign's meter is the CPU estimate: its energies are "metered", never called
        # measured (`measured_config`: the what-if's configuration whose tree a TP takes).
        kfold = (workdir / "my-campaign" / "report" / "kfold" / "index.html").read_text()
        assert "meter: cpu-estimate (estimated)" in page and "roots metered:" in page
        for text in (page, kfold):
            assert "measured" not in text.replace("measured_config", ""), text[:300]
        # The copy's dataset names its span files from the copy, not from where they were made.
        assert_sources_under(workdir / "my-campaign")
    if "calibrate report" in command:
        page = (workdir / "kfold-report" / "index.html").read_text()
        assert '<a href="residuals.png">' in page and '<a href="per_type.png">' in page
