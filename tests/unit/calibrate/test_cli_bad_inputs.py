"""`python -m vllm_piep.calibrate` on bad input: every subcommand, over a corpus of missing,
empty, truncated, binary, wrong-column, wrong-type, non-JSON, zero and negative inputs, exits 2
with exactly one line on stderr that names the offending file, field or value. Exit 1 (a
traceback) is left for bugs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from support.cli_checks import check_usage_error
from support.cli_checks import write_input as _text

from tests.support.paths import PUBLISHED_DATA, SHIPPED_BUNDLE
from vllm_piep.calibrate.__main__ import main

V2 = PUBLISHED_DATA / "mlenergy-v2" / "a100_configs.csv"
V3 = PUBLISHED_DATA / "mlenergy-v3" / "h100_configs.csv"
STRUCTURES = PUBLISHED_DATA / "model_structures.csv"
IRENE = PUBLISHED_DATA / "irene" / "device_1"
PNG_BYTES = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"


def _v2(tmp: Path, name: str, change: Callable[[pd.DataFrame], pd.DataFrame]) -> Path:
    path = tmp / name
    change(pd.read_csv(V2).head(6)).to_csv(path, index=False)
    return path


def _truncated(tmp: Path) -> Path:
    """The v2 table cut in the middle of its first data row (a download that stopped)."""
    lines = V2.read_text().splitlines()
    return _text(tmp, "truncated.csv", lines[0] + "\n" + lines[1][: len(lines[1]) // 3])


def _evaluation(tmp: Path, result: object, predictions: bytes | None = b"") -> Path:
    path = _text(tmp, "eval.json", json.dumps(result))
    if predictions:
        _text(tmp, "eval.json.predictions.parquet", predictions)
    return path


def _bundle_copy(tmp: Path, manifest: str) -> Path:
    out = tmp / "bundle"
    out.mkdir()
    for f in SHIPPED_BUNDLE.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "manifest.json").write_text(manifest)
    return out


def _dir(path: Path) -> Path:
    path.mkdir()
    return path


def _campaign(tmp: Path, state: str | None) -> Path:
    out = tmp / "campaign"
    out.mkdir()
    if state is not None:
        (out / "campaign.json").write_text(state)
    return out


def _mlenergy(cmd: str, data: Path | str, structures: Path | str = STRUCTURES) -> list[str]:
    tail = (["--json", "OUT/e.json"] if cmd == "evaluate" else ["--out", "OUT/bundle"])
    return [cmd, "--dataset", "mlenergy", "--data", str(data), "--structures", str(structures),
            "--no-progress", *tail]


def _prior(cmd: str, data: Path | str, structures: Path | str = STRUCTURES) -> list[str]:
    tail = ["--no-progress"] if cmd == "validate-prior" else []
    return [cmd, "--data", str(data), "--structures", str(structures), "--out", "OUT/p", *tail]


def _whatif(*flags: str, bundle: Path | str = SHIPPED_BUNDLE) -> list[str]:
    return ["whatif", "--bundle", str(bundle), *flags]


# (id, argv maker given a scratch dir, what the one line must contain). "OUT" in an argv is
# replaced by a scratch output directory.
Case = tuple[str, Callable[[Path], list[str]], str]
CASES: list[Case] = [
    # evaluate / train --dataset mlenergy
    ("evaluate-missing", lambda t: _mlenergy("evaluate", t / "nope.csv"), "nope.csv"),
    ("evaluate-empty", lambda t: _mlenergy("evaluate", _text(t, "e.csv", "")), "e.csv"),
    ("evaluate-header-only", lambda t: _mlenergy(
        "evaluate", _text(t, "h.csv", V2.read_text().splitlines()[0] + "\n")), "h.csv"),
    ("evaluate-truncated", lambda t: _mlenergy("evaluate", _truncated(t)), "truncated.csv"),
    ("evaluate-binary", lambda t: _mlenergy("evaluate", _text(t, "b.csv", PNG_BYTES)), "b.csv"),
    ("evaluate-wrong-columns", lambda t: _mlenergy(
        "evaluate", _text(t, "w.csv", "a,b\n1,2\n")), "missing columns"),
    ("evaluate-dropped-column", lambda t: _mlenergy("evaluate", _v2(
        t, "d.csv", lambda df: df.drop(columns=["Energy/req (J)"]))), "Energy/req (J)"),
    ("evaluate-wrong-types", lambda t: _mlenergy("evaluate", _v2(
        t, "ty.csv", lambda df: df.assign(TP="two"))), "TP"),
    ("evaluate-negative-energy", lambda t: _mlenergy("evaluate", _v2(
        t, "neg.csv", lambda df: df.assign(**{"Energy/req (J)": -5.0}))), "not positive"),
    ("evaluate-zero-tp", lambda t: _mlenergy("evaluate", _v2(
        t, "zero.csv", lambda df: df.assign(TP=0))), "TP"),
    ("evaluate-no-structures", lambda t: [
        "evaluate", "--dataset", "mlenergy", "--data", str(V2), "--json", "OUT/e.json"],
     "--structures"),
    ("evaluate-structures-empty", lambda t: _mlenergy(
        "evaluate", V2, _text(t, "s.csv", "")), "s.csv"),
    ("evaluate-structures-wrong-columns", lambda t: _mlenergy(
        "evaluate", V2, _text(t, "s.csv", "model_id,x\na,1\n")), "hidden_size"),
    ("evaluate-data-is-a-directory", lambda t: _mlenergy("evaluate", _dir(t / "adir")),
     "adir"),
    ("evaluate-irene-missing", lambda t: [
        "evaluate", "--dataset", "irene", "--data", str(t / "nodir"), "--json", "OUT/e.json"],
     "nodir"),
    ("evaluate-irene-empty-dir", lambda t: [
        "evaluate", "--dataset", "irene", "--data", str(t), "--json", "OUT/e.json"],
     "model_level_features.csv"),
    ("evaluate-bad-protocol", lambda t: [
        "evaluate", "--dataset", "irene", "--data", str(IRENE), "--protocol", "leave-two-out",
        "--json", "OUT/e.json"], "leave-two-out"),
    ("train-empty", lambda t: _mlenergy("train", _text(t, "e.csv", "")), "e.csv"),
    ("train-wrong-columns", lambda t: _mlenergy(
        "train", _text(t, "w.csv", "x\n1\n")), "w.csv"),
    # fit-prior / validate-prior
    ("validate-prior-missing", lambda t: _prior("validate-prior", t / "gone.csv"), "gone.csv"),
    ("validate-prior-empty", lambda t: _prior("validate-prior", _text(t, "e.csv", "")),
     "e.csv"),
    ("validate-prior-binary", lambda t: _prior("validate-prior", _text(t, "b.csv", PNG_BYTES)),
     "b.csv"),
    ("validate-prior-wrong-columns", lambda t: _prior(
        "validate-prior", _text(t, "w.csv", "a,b\n1,2\n")), "missing columns"),
    ("validate-prior-negative", lambda t: _prior("validate-prior", _v2(
        t, "neg.csv", lambda df: df.assign(**{"Avg BS (reqs)": -1.0}))),
     "neg.csv:2: Avg BS (reqs) is -1.0"),
    ("validate-prior-structures-empty", lambda t: _prior(
        "validate-prior", V2, _text(t, "s.csv", "")), "s.csv"),
    ("fit-prior-empty", lambda t: _prior("fit-prior", _text(t, "e.csv", "")), "e.csv"),
    ("fit-prior-truncated", lambda t: _prior("fit-prior", _truncated(t)), "truncated.csv"),
    # report
    ("report-missing", lambda t: ["report", "--json", str(t / "r.json"), "--html", "OUT/h"],
     "r.json"),
    ("report-empty", lambda t: ["report", "--json", str(_text(t, "r.json", "")), "--html",
                                "OUT/h"], "r.json"),
    ("report-not-json", lambda t: ["report", "--json", str(_text(t, "r.json", "<html>")),
                                   "--html", "OUT/h"], "not JSON"),
    ("report-json-list", lambda t: ["report", "--json", str(_text(t, "r.json", "[1, 2]")),
                                    "--html", "OUT/h"], "list"),
    ("report-json-missing-field", lambda t: ["report", "--json", str(_evaluation(
        t, {"levels": {}, "per_model": {}, "baselines": {}})), "--html", "OUT/h"],
     "predictions_file"),
    ("report-predictions-missing", lambda t: ["report", "--json", str(_evaluation(
        t, {"predictions_file": "gone.parquet", "levels": {}, "per_model": {},
            "baselines": {}})), "--html", "OUT/h"], "gone.parquet"),
    ("report-predictions-not-parquet", lambda t: ["report", "--json", str(_evaluation(
        t, {"predictions_file": "eval.json.predictions.parquet", "levels": {},
            "per_model": {}, "baselines": {}}, b"not parquet")), "--html", "OUT/h"],
     "predictions.parquet"),
    # whatif
    ("whatif-tp-zero", lambda t: _whatif("--tp", "0"), "--tp"),
    ("whatif-tp-negative", lambda t: _whatif("--tp", "1,-2"), "-2"),
    ("whatif-batch-text", lambda t: _whatif("--batch", "eight"), "eight"),
    ("whatif-context-zero", lambda t: _whatif("--context", "0"), "--context"),
    ("whatif-pp-zero", lambda t: _whatif("--pp", "0"), "--pp"),
    ("whatif-batch-beyond-factor", lambda t: _whatif("--batch", "1,64"), "--batch 64"),
    ("whatif-tp-beyond-factor", lambda t: _whatif("--tp", "16"), "--tp 16"),
    ("whatif-bundle-missing", lambda t: _whatif(bundle=t / "nobundle"), "nobundle"),
    ("whatif-manifest-not-json", lambda t: _whatif(bundle=_bundle_copy(t, "{not json")),
     "manifest.json"),
    ("whatif-manifest-no-grid", lambda t: _whatif(bundle=_bundle_copy(
        t, SHIPPED_BUNDLE.joinpath("manifest.json").read_text().replace(
            "calibrate run --quick", "calibrate nothing"))), "how_to_remake"),
    # finish
    ("finish-missing", lambda t: ["finish", "--out", str(t / "nocampaign")], "nocampaign"),
    ("finish-no-state", lambda t: ["finish", "--out", str(_campaign(t, None))],
     "campaign.json"),
    ("finish-state-empty", lambda t: ["finish", "--out", str(_campaign(t, ""))],
     "campaign.json"),
    ("finish-state-not-json", lambda t: ["finish", "--out", str(_campaign(t, "plan: x"))],
     "campaign.json"),
    ("finish-state-wrong-fields", lambda t: ["finish", "--out", str(_campaign(
        t, json.dumps({"schema": "piep.campaign/1", "plan": 3})))], "plan"),
    # from-metrics
    ("from-metrics-missing", lambda t: ["from-metrics", str(t / "m.txt"), "--out", "OUT/f"],
     "m.txt"),
    ("from-metrics-empty", lambda t: ["from-metrics", str(_text(t, "m.txt", "")), "--out",
                                      "OUT/f"], "m.txt"),
    ("from-metrics-binary", lambda t: ["from-metrics", str(_text(t, "m.txt", PNG_BYTES)),
                                       "--out", "OUT/f"], "m.txt"),
    # run: refused before any server starts
    ("run-tp-zero", lambda t: ["run", "--model", str(t), "--out", "OUT/c", "--tp", "0"],
     "--tp"),
    ("run-bad-meter", lambda t: ["run", "--model", str(t), "--out", "OUT/c", "--quick",
                                 "--meter", "bogus"], "bogus"),
    ("run-negative-interval", lambda t: ["run", "--model", str(t), "--out", "OUT/c", "--quick",
                                         "--meter-interval", "-1"], "meter_interval_s"),
    # argparse itself
    ("unknown-command", lambda t: ["calibrate-everything"], "calibrate-everything"),
    ("missing-required", lambda t: ["whatif"], "--bundle"),
    ("unknown-option", lambda t: ["report", "--json", "x", "--html", "y", "--colour"],
     "--colour"),
]


def _argv(make: Callable[[Path], list[str]], tmp_path: Path) -> list[str]:
    scratch = tmp_path / "in"
    scratch.mkdir()
    (tmp_path / "out").mkdir()
    return [a.replace("OUT", str(tmp_path / "out")) for a in make(scratch)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case: Case, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    _, make, named = case
    check_usage_error(main, _argv(make, tmp_path), "python -m vllm_piep.calibrate", named, capsys)


SUBPROCESS_CASES = ("evaluate-empty", "report-not-json", "whatif-tp-zero",
                    "evaluate-no-structures", "finish-state-not-json", "missing-required")


@pytest.mark.slow
@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_through_the_real_command_line(name: str, tmp_path: Path) -> None:
    _, make, named = next(c for c in CASES if c[0] == name)
    proc = subprocess.run([sys.executable, "-m", "vllm_piep.calibrate", *_argv(make, tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("python -m vllm_piep.calibrate"), proc.stderr
    assert named in proc.stderr


@pytest.mark.parametrize("argv,option", [
    (_whatif("--json", "NODIR/w.json"), "--json"),
    (_whatif("--png", "NODIR/w.png"), "--png"),
    (["evaluate", "--dataset", "irene", "--data", "d", "--json", "NODIR/e.json"], "--json"),
    (["from-metrics", "m.txt", "--out", "NODIR/f.json"], "--out"),
    (["fit-prior", "--data", "d.csv", "--structures", "s.csv", "--out", "NODIR/p.json"],
     "--out"),
], ids=["whatif-json", "whatif-png", "evaluate-json", "from-metrics-out", "fit-prior-out"])
def test_an_output_file_in_a_missing_directory_is_refused_and_nothing_is_written(
        argv: list[str], option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An output file names an existing directory (a typo there is refused, not created);
    output directories (--out DIR, --html DIR) are created."""
    monkeypatch.chdir(tmp_path)
    nodir = tmp_path / "nodir"
    argv = [a.replace("NODIR", str(nodir)) for a in argv]
    path = next(a for a in argv if a.startswith(str(nodir)))
    check_usage_error(main, argv, "python -m vllm_piep.calibrate",
                      f"{option} {path}: its directory {nodir} does not exist", capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_is_not_prometheus_text_is_named_with_its_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    _text(tmp_path, "README.md", "# vllm_piep\n\nA vLLM plugin that tells\n")
    check_usage_error(main, ["from-metrics", "README.md"],
                      "python -m vllm_piep.calibrate from-metrics",
                      "README.md: not a Prometheus text exposition (line 3: 'A vLLM plugin "
                      "that tells'", capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]  # no prior-correction.json


def test_the_corpus_covers_every_subcommand() -> None:
    from vllm_piep.calibrate.__main__ import parser

    sub = next(a for a in parser()._actions if a.dest == "command")
    names = [c[0] for c in CASES]
    for command in sub.choices:
        assert any(n.startswith(f"{command}-") for n in names), f"no bad input for {command}"
