"""The other command lines on bad input: `python -m vllm_piep.meters` (and its `vllm_piep.meter`
spelling), `python -m vllm_piep.spans` and `python -m kernels_trace`, over a corpus of missing,
empty, truncated, binary, wrong-column, wrong-type, non-JSON, zero and negative inputs, exit 2
with exactly one line on stderr naming the offending file, field or value. Exit 1 (a
traceback) is left for bugs. Every option of every one documents itself and its default."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support.cli_checks import check_options_documented, check_usage_error
from support.cli_checks import write_input as _text
from support.paths import ROOT

from kernels_trace.__main__ import main as kernels_trace_main
from kernels_trace.__main__ import parser as kernels_trace_parser
from vllm_piep.meters.__main__ import main as meters_main
from vllm_piep.meters.__main__ import parser as meters_parser
from vllm_piep.spans.__main__ import main as spans_main
from vllm_piep.spans.__main__ import parser as spans_parser
from vllm_piep.spans.records import SpanHeader
from vllm_piep.spans.writer import SpanWriter

PNG_BYTES = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"
CLIS: dict[str, Callable[[list[str]], int]] = {
    "python -m vllm_piep.meters": meters_main,
    "python -m vllm_piep.spans": spans_main,
    "python -m kernels_trace": kernels_trace_main,
}


def _dir(path: Path) -> Path:
    path.mkdir()
    return path


def _span_dir(tmp: Path) -> Path:
    """A real one-rank span file of one step, written by the plugin's writer."""
    out = _dir(tmp / "spans")
    writer = SpanWriter(out / "i1-dp0-rank000.spans.jsonl",
                        SpanHeader(rank=0, world_size=1, host="h", pid=1, instance="i1"))
    writer.put({"kind": "step", "step": 0, "start_ns": 0, "end_ns": 10, "prefill_tokens": 3,
                "decode_tokens": 1, "num_reqs": 2})
    writer.close()
    return out


def _span_file(tmp: Path, body: str) -> Path:
    """A span file whose header is real and whose records are `body`."""
    header = (_span_dir(tmp) / "i1-dp0-rank000.spans.jsonl").read_text().splitlines()[0]
    return _text(tmp, "bad/i2-dp0-rank000.spans.jsonl", header + "\n" + body)


def _log(tmp: Path, text: str | bytes) -> list[str]:
    path = _text(tmp, "power.csv", text)
    return ["--meter", "external", "--external-log", str(path), "--seconds", "0.2",
            "--interval", "0.1"]


def _kineto(tmp: Path, name: str, data: object) -> Path:
    return _text(tmp, name, json.dumps(data))


M, S, K = "python -m vllm_piep.meters", "python -m vllm_piep.spans", "python -m kernels_trace"
SIM = ["--meter", "simulated", "--interval", "0.05"]
# (id, CLI, argv maker given a scratch dir, what the one line must contain). "OUT" in an argv is
# replaced by a scratch output directory.
Case = tuple[str, str, Callable[[Path], list[str]], str]
CASES: list[Case] = [
    # meters
    ("meters-seconds-zero", M, lambda t: ["--seconds", "0"], "--seconds"),
    ("meters-seconds-negative", M, lambda t: ["--seconds", "-2"], "-2"),
    ("meters-seconds-not-a-number", M, lambda t: ["--seconds", "five"], "five"),
    ("meters-interval-zero", M, lambda t: ["--interval", "0"], "--interval"),
    ("meters-unknown-meter", M, lambda t: ["--meter", "bogus"], "bogus"),
    ("meters-external-without-log", M, lambda t: ["--meter", "external", "--seconds", "0.1"],
     "--external-log"),
    ("meters-external-log-missing", M, lambda t: ["--meter", "external", "--external-log",
                                                  str(t / "nolog.csv")], "nolog.csv"),
    ("meters-external-log-empty", M, lambda t: _log(t, ""), "power.csv"),
    ("meters-external-log-header-only", M, lambda t: _log(t, "timestamp,watts\n"),
     "no samples"),
    ("meters-external-log-wrong-columns", M, lambda t: _log(t, "time,power\n1,2\n"), "timestamp"),
    ("meters-external-log-wrong-type", M, lambda t: _log(t, "timestamp,watts\n1,abc\n"), "abc"),
    ("meters-external-log-binary", M, lambda t: _log(t, PNG_BYTES + b"\n"), "power.csv"),
    ("meters-external-log-stale", M, lambda t: _log(t, "timestamp,watts\n1,100\n2,100\n"),
     "outside the log"),
    ("meters-rapl-missing", M, lambda t: ["--meter", "rapl", "--seconds", "0.1", "--rapl-root",
                                          str(t / "norapl")], "RAPL"),
    ("meters-nothing-after-dashes", M, lambda t: ["--"], "'--'"),
    ("meters-command-missing", M, lambda t: [*SIM, "--", str(t / "nocmd")], "nocmd"),
    ("meters-command-with-seconds", M, lambda t: ["--seconds", "1", "--", "true"], "--seconds"),
    ("meters-command-with-json", M, lambda t: ["--json", "--", "true"], "--json-file"),
    ("meters-csv-dir-missing", M, lambda t: [*SIM, "--seconds", "0.1", "--csv",
                                             str(t / "nodir" / "m.csv")], "nodir"),
    ("meters-csv-foreign", M, lambda t: [*SIM, "--seconds", "0.1", "--csv",
                                         str(_text(t, "f.csv", "a,b\n1,2\n"))], "f.csv"),
    ("meters-json-file-dir-missing", M, lambda t: [*SIM, "--seconds", "0.1", "--json-file",
                                                   str(t / "nodir" / "m.json")], "nodir"),
    # spans
    ("spans-missing", S, lambda t: ["show", str(t / "nospans")], "nospans"),
    ("spans-empty-dir", S, lambda t: ["show", str(_dir(t / "empty"))], "no span files"),
    ("spans-empty-file", S, lambda t: ["show", str(_text(t, "e.spans.jsonl", ""))],
     "e.spans.jsonl"),
    ("spans-not-json", S, lambda t: ["show", str(_text(t, "n.spans.jsonl", "not json\n"))],
     "n.spans.jsonl"),
    ("spans-binary", S, lambda t: ["show", str(_text(t, "b.spans.jsonl", PNG_BYTES))],
     "b.spans.jsonl"),
    ("spans-wrong-schema", S, lambda t: ["show", str(_text(
        t, "s.spans.jsonl", json.dumps({"schema": "other/9", "rank": 0}) + "\n"))],
     "s.spans.jsonl"),
    ("spans-record-wrong-type", S, lambda t: ["show", str(_span_file(
        t, json.dumps({"kind": "step", "step": "first", "start_ns": 0, "end_ns": 1}) + "\n"))],
     ":2"),
    ("spans-record-unknown-kind", S, lambda t: ["show", str(_span_file(
        t, json.dumps({"kind": "teapot"}) + "\n"))], "teapot"),
    ("spans-step-absent", S, lambda t: ["show", str(_span_dir(t)), "--step", "99"], "step 99"),
    ("spans-step-not-an-integer", S, lambda t: ["show", str(_span_dir(t)), "--step", "x"],
     "'x'"),
    ("spans-instance-absent", S, lambda t: ["show", str(_span_dir(t)), "--instance", "i9"],
     "i9"),
    ("spans-tree-missing", S, lambda t: ["tree", str(t / "nospans")], "nospans"),
    ("spans-no-command", S, lambda t: [], "command"),
    # kernels_trace
    ("kernels_trace-missing", K, lambda t: [str(t / "no.json"), "--json", "OUT/m.json"],
     "no.json"),
    ("kernels_trace-empty", K, lambda t: [str(_text(t, "e.json", "")), "--json", "OUT/m.json"],
     "e.json"),
    ("kernels_trace-not-json", K, lambda t: [str(_text(t, "n.json", "{ph: X")), "--json",
                                             "OUT/m.json"], "n.json"),
    ("kernels_trace-binary", K, lambda t: [str(_text(t, "b.json", PNG_BYTES)), "--json",
                                           "OUT/m.json"], "b.json"),
    ("kernels_trace-truncated-gzip", K, lambda t: [str(_text(t, "c.json.gz", b"\x1f\x8b\x08")),
                                                   "--json", "OUT/m.json"], "c.json.gz"),
    ("kernels_trace-no-events", K, lambda t: [str(_kineto(t, "x.json", {"a": 1})), "--json",
                                              "OUT/m.json"], "traceEvents"),
    ("kernels_trace-no-rank", K, lambda t: [str(_kineto(t, "r.json", {"traceEvents": []})),
                                            "--json", "OUT/m.json"], "--rank"),
    ("kernels_trace-rank-negative", K, lambda t: [str(_kineto(t, "r.json", {"traceEvents": []})),
                                                  "--rank", "-1", "--json", "OUT/m.json"], "-1"),
    ("kernels_trace-rank-of-two", K, lambda t: [
        str(_kineto(t, "a.json", {"traceEvents": []})),
        str(_kineto(t, "b.json", {"traceEvents": []})), "--rank", "0", "--json", "OUT/m.json"],
     "--rank 0"),
    ("kernels_trace-offset-not-pair", K, lambda t: [
        str(_kineto(t, "r.json", {"traceEvents": []})), "--rank", "0", "--offset", "5",
        "--json", "OUT/m.json"], "'5'"),
    ("kernels_trace-offset-not-integer", K, lambda t: [
        str(_kineto(t, "r.json", {"traceEvents": []})), "--rank", "0", "--offset", "a=b",
        "--json", "OUT/m.json"], "a=b"),
    ("kernels_trace-nsys-not-sqlite", K, lambda t: [str(_text(t, "x.sqlite", "not a db" * 64)),
                                                    "--json", "OUT/m.json"], "x.sqlite"),
    ("kernels_trace-events-not-a-list", K, lambda t: [
        str(_kineto(t, "l.json", {"traceEvents": {"ph": "X"}})), "--rank", "0", "--json",
        "OUT/m.json"], "traceEvents"),
    ("kernels_trace-json-is-a-directory", K, lambda t: [
        str(_kineto(t, "r.json", {"traceEvents": []})), "--rank", "0", "--json", "OUT"],
     "is a directory"),
    ("meters-external-setting-log-missing", M, lambda t: [
        "--meter", f"external:{t / 'nolog.csv'}", "--seconds", "0.1"], "nolog.csv"),
    ("meters-external-setting-with-external-log", M, lambda t: [
        "--meter", "external:p.csv", "--external-log", "p.csv"], "--meter external"),
    ("meters-callable-not-importable", M, lambda t: [
        "--meter", "no_such_module:meter", "--seconds", "0.1"], "no_such_module"),
]


def _argv(make: Callable[[Path], list[str]], tmp_path: Path) -> list[str]:
    scratch = tmp_path / "in"
    scratch.mkdir()
    (tmp_path / "out").mkdir()
    return [a.replace("OUT", str(tmp_path / "out")) for a in make(scratch)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case: Case, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    _, prog, make, named = case
    check_usage_error(CLIS[prog], _argv(make, tmp_path), prog, named, capsys)


def test_the_corpus_covers_every_cli_and_spans_subcommand(tmp_path: Path) -> None:
    assert {c[1] for c in CASES} == set(CLIS)
    sub = next(a for a in spans_parser()._actions if isinstance(a, argparse._SubParsersAction))
    used = set()
    for i, (_, prog, make, _) in enumerate(CASES):
        if prog == S:
            argv = make(_dir(tmp_path / str(i)))
            used.update(argv[:1])
    assert set(sub.choices) <= used


@pytest.mark.slow
@pytest.mark.parametrize("module,name", [
    ("vllm_piep.meters", "meters-external-log-empty"),
    ("vllm_piep.meter", "meters-seconds-zero"),  # argparse's error
    ("vllm_piep.meter", "meters-external-log-empty"),  # the work's
    ("vllm_piep.meter", "meters-nothing-after-dashes"),
    ("vllm_piep.spans", "spans-not-json"),
    ("vllm_piep.spans", "spans-step-not-an-integer"),  # a subcommand's argparse error
    ("kernels_trace", "kernels_trace-no-rank"),
])
def test_bad_input_through_the_real_command_line(module: str, name: str,
                                                 tmp_path: Path) -> None:
    """The one line names the command as the user typed it."""
    _, _, make, named = next(c for c in CASES if c[0] == name)
    proc = subprocess.run([sys.executable, "-m", module, *_argv(make, tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"python -m {module}:") or \
        proc.stderr.startswith(f"python -m {module} "), proc.stderr  # `spans show: ...`
    assert named in proc.stderr


TRACE = ROOT / "examples" / "traces" / "single-process.json.gz"


@pytest.mark.parametrize("prog,argv,option", [
    (K, [str(TRACE), "--rank", "0", "--json", "NODIR/m.json"], "--json"),
    (M, [*SIM, "--seconds", "0.1", "--json-file", "NODIR/m.json"], "--json-file"),
    (M, [*SIM, "--seconds", "0.1", "--csv", "NODIR/m.csv"], "--csv"),
], ids=["kernels_trace-json", "meters-json-file", "meters-csv"])
def test_an_output_file_in_a_missing_directory_is_refused_and_nothing_is_written(
        prog: str, argv: list[str], option: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An output file names an existing directory (a typo there is refused, not created)."""
    monkeypatch.chdir(tmp_path)
    nodir = tmp_path / "nodir"
    argv = [a.replace("NODIR", str(nodir)) for a in argv]
    path = next(a for a in argv if a.startswith(str(nodir)))
    check_usage_error(CLIS[prog], argv, prog,
                      f"{option} {path}: its directory {nodir} does not exist", capsys)
    assert list(tmp_path.iterdir()) == []


def _parsers() -> dict[str, argparse.ArgumentParser]:
    spans = spans_parser()
    sub = next(a for a in spans._actions if isinstance(a, argparse._SubParsersAction))
    return {"meters": meters_parser(), "kernels_trace": kernels_trace_parser(),
            **{f"spans {n}": p for n, p in sub.choices.items()}}


@pytest.mark.parametrize("name", sorted(_parsers()))
def test_every_option_has_help_and_its_default(name: str) -> None:
    check_options_documented(name, _parsers()[name])
