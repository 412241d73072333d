"""The billing ledger's file (`vllm_piep.ledger`): rows written off the serving path, bounded,
one transaction per flush; bad stores refused in one line; rows read back once however many
copies are given; a writer killed with SIGKILL leaves a sound file that the next one appends
to; two processes writing one file never mix their rows."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pandas as pd
import pytest

from vllm_piep.ledger import store, summary
from vllm_piep.ledger.__main__ import main
from vllm_piep.ledger.schema import LedgerRow
from vllm_piep.ledger.writer import LedgerWriter, coalesce

T0 = 1_764_000_000.0  # 2025-11-24T16:00Z


def request_row(i: int, tenant: str | None = "acme", at: float = T0, joules: float = 1.0,
                outcome: str = "finished") -> LedgerRow:
    return LedgerRow("request", outcome, at, joules, "prior", "prior/x", None, f"cmpl-{i}",
                     f"int-{i}", "llama", tenant, None, at - 1, 10, 5, joules / 4,
                     joules * 3 / 4, {"mlp": joules / 2, "attention": joules / 2}, None)


def engine_row(outcome: str, joules: float, at: float = T0) -> LedgerRow:
    return LedgerRow("engine", outcome, at, joules, "prior", engine="0")


def written(path: Path, rows: list[LedgerRow], **kwargs: object) -> LedgerWriter:
    writer = LedgerWriter(path, flush_s=0.05, **kwargs)  # type: ignore[arg-type]
    for row in rows:
        writer.put(row)
    writer.close()
    return writer


def test_rows_come_back_once_from_any_number_of_copies_summed_by_tenant_and_day(
        tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    rows = [request_row(i, "acme" if i % 3 else "globex", T0 + 86_400 * (i % 2), 1.0 + i)
            for i in range(12)]
    late = msgspec.structs.replace(request_row(4, "acme", T0, 0.5, "after_finish"), later=True,
                                   prompt_tokens=None, output_tokens=None)
    rows += [late,
             engine_row("unsent", 0.25), engine_row("unsent", 0.5), engine_row("warmup", 2.0)]
    counts: list[int] = []
    written(path, rows, on_written=counts.append)
    copy = tmp_path / "copy.db"
    copy.write_bytes(path.read_bytes())
    frame = summary.read([path, copy])
    assert len(frame) == len(rows) - 1 == sum(counts)  # the two unsent rows are one
    table = summary.summarize(frame, ["tenant", "day"])
    by = {(r["tenant"], r["day"]): r for r in table}
    expect_joules = sum(r.joules for r in rows)
    assert sum(r["joules"] for r in table) == pytest.approx(expect_joules, rel=1e-12)
    acme_day0 = [r for r in rows if r.kind == "request" and r.tenant == "acme"
                 and r.recorded_at == T0]
    got = by[("acme", "2025-11-24")]
    assert got["joules"] == pytest.approx(sum(r.joules for r in acme_day0))
    assert got["requests"] == len({r.internal_id for r in acme_day0})  # after_finish: no new one
    assert got["output_tokens"] == 5 * got["requests"]
    assert by[(None, "2025-11-24")]["requests"] == 0  # engine rows: no tenant, no request
    assert by[(None, "2025-11-24")]["joules"] == pytest.approx(2.75)


def test_the_command_line_prints_json_csv_and_a_table_and_exports_parquet_and_csv(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "l.db"
    written(path, [request_row(i, f"t{i % 2}") for i in range(4)])
    assert main(["summary", "--by", "tenant,model", "--format", "json", str(path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["tenant"], r["model"], r["requests"]) for r in rows] == [
        ("t0", "llama", 2), ("t1", "llama", 2)]
    assert main(["summary", "--by", "month", "--format", "csv", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("2025-11,4,4.0")
    assert main(["summary", str(path)]) == 0
    assert "total" in capsys.readouterr().out
    assert main(["summary", "--since", "2025-11-25", "--format", "json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == []
    for fmt in ("parquet", "csv"):
        out = tmp_path / f"rows.{fmt}"
        assert main(["export", "--format", fmt, "--out", str(out), str(path)]) == 0
        frame = pd.read_parquet(out) if fmt == "parquet" else pd.read_csv(out)
        assert len(frame) == 4 and frame["joules_mlp"].sum() == pytest.approx(2.0)


def test_small_totals_keep_their_digits_in_the_table_csv_and_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A request's joules are small: the table shows four significant digits (its total the
    rows' exact sum, kWh never 0.000000), the CSV and JSON every digit."""
    path = tmp_path / "small.db"
    written(path, [request_row(0, "t0", joules=0.64), request_row(1, "t1", joules=0.26)])
    assert main(["summary", "--by", "tenant", str(path)]) == 0
    table = capsys.readouterr().out
    for shown in ("0.6400", "0.2600", "0.9000", "0.0000001778", "0.00000007222",
                  "0.0000002500"):  # joules, then kWh
        assert shown in table, (shown, table)
    assert "0.000000 " not in table
    assert main(["summary", "--by", "tenant", "--format", "csv", str(path)]) == 0
    rows = pd.read_csv(pd.io.common.StringIO(capsys.readouterr().out))
    assert rows["joules"].tolist() == [0.64, 0.26]
    assert main(["summary", "--by", "tenant", "--format", "json", str(path)]) == 0
    assert [r["joules"] for r in json.loads(capsys.readouterr().out)] == [0.64, 0.26]


@pytest.mark.parametrize("value, shown", [
    (0.64, "0.6400"), (0.9, "0.9000"), (1.0, "1.000"), (12.345, "12.35"), (999.95, "1000"),
    (123456.7, "123457"), (2.5e-7, "0.0000002500"), (-0.012, "-0.01200"), (0.0, "0")])
def test_figures_keep_four_significant_digits(value: float, shown: str) -> None:
    assert summary.significant(value) == shown


@pytest.mark.parametrize("args, message", [
    (["summary", "{missing}"], "no such ledger"),
    (["summary", "{text}"], "not a readable ledger"),
    (["summary", "{other_db}"], "not a ledger"),
    (["summary", "--by", "tenant,week", "{ok}"], "unknown key 'week'"),
    (["summary", "--since", "last tuesday", "{ok}"], "expected an ISO date"),
    (["export", "--out", "{tmp}/no/such/dir/x.parquet", "{ok}"], "does not exist"),
])
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "text.db").write_text("hello\n")
    with sqlite3.connect(tmp_path / "other.db") as conn:
        conn.execute("CREATE TABLE t (x)")
    written(tmp_path / "ok.db", [request_row(0)])
    paths = {"missing": tmp_path / "missing.db", "text": tmp_path / "text.db",
             "other_db": tmp_path / "other.db", "ok": tmp_path / "ok.db", "tmp": tmp_path}
    assert main([a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_store_that_cannot_serve_is_refused_at_open_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(store.LedgerError, match="directory .* does not exist"):
        store.connect(tmp_path / "nope" / "l.db")
    (tmp_path / "junk.db").write_bytes(os.urandom(4096))
    with pytest.raises(store.LedgerError, match="not a readable ledger"):
        store.connect(tmp_path / "junk.db")
    with sqlite3.connect(tmp_path / "v0.db") as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        conn.execute("INSERT INTO meta VALUES ('schema_version', '0')")
    with pytest.raises(store.LedgerError, match="schema version 0"):
        store.connect(tmp_path / "v0.db")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "ro"
        locked.mkdir()
        locked.chmod(0o500)
        with pytest.raises(store.LedgerError, match="cannot be written"):
            store.connect(locked / "l.db")


def test_a_full_queue_drops_and_counts_and_never_blocks(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer stuck in a commit: its queue fills, and what does not fit is dropped,
    counted, at once."""
    committing, release = threading.Event(), threading.Event()
    real = store.insert

    def slow(*args: object) -> None:
        committing.set()
        release.wait(30)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr("vllm_piep.ledger.writer.insert", slow)
    dropped: list[int] = []
    writer = LedgerWriter(tmp_path / "l.db", flush_s=0.01, capacity=3, on_dropped=dropped.append)
    writer.put(request_row(0))
    assert committing.wait(30)
    start = time.perf_counter()
    for i in range(1, 51):
        writer.put(request_row(i))
    assert time.perf_counter() - start < 1.0
    assert sum(dropped) == 50 - 3
    release.set()
    writer.close()
    assert sorted(summary.read([tmp_path / "l.db"])["internal_id"]) == [
        f"int-{i}" for i in range(4)]


def test_a_failed_commit_keeps_its_rows_for_the_next_flush(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    failures = [sqlite3.OperationalError("database or disk is full")] * 2
    real = store.insert

    def flaky(*args: object) -> None:
        if failures:
            raise failures.pop()
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr("vllm_piep.ledger.writer.insert", flaky)
    dropped: list[int] = []
    writer = LedgerWriter(tmp_path / "l.db", flush_s=0.02, on_dropped=dropped.append)
    for i in range(5):
        writer.put(request_row(i))
        time.sleep(0.03)
    writer.close()
    assert not failures and not dropped
    assert sorted(summary.read([tmp_path / "l.db"])["internal_id"]) == [f"int-{i}"
                                                                         for i in range(5)]


def test_a_store_that_keeps_failing_holds_a_bounded_batch_and_counts_every_row_it_drops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr("vllm_piep.ledger.writer.insert", full)
    dropped: list[int] = []
    writer = LedgerWriter(tmp_path / "l.db", flush_s=0.01, capacity=5,
                          on_dropped=dropped.append)
    for i in range(40):
        writer.put(request_row(i))
        time.sleep(0.002)
    time.sleep(0.1)
    assert len(writer._pending) <= 5 and writer._queue.qsize() <= 5
    writer.close()
    assert sum(dropped) == 40


def test_engine_rows_of_one_flush_are_summed_and_request_rows_kept() -> None:
    rows = [engine_row("unsent", 1.0), request_row(1), engine_row("unsent", 2.0, T0 + 1),
            engine_row("warmup", 4.0)]
    merged = coalesce(rows)
    assert [(r.kind, r.outcome, r.joules) for r in merged] == [
        ("engine", "unsent", 3.0), ("request", "finished", 1.0), ("engine", "warmup", 4.0)]
    assert merged[0].recorded_at == T0 + 1


def _write_forever(path: str, flush_s: float) -> None:
    writer = LedgerWriter(path, flush_s=flush_s)
    i = 0
    while True:
        writer.put(request_row(i, at=time.time()))
        i += 1
        time.sleep(0.0005)


def test_sigkill_leaves_a_sound_file_that_the_next_writer_appends_to(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.path[:0] = sys.argv[3:]; "
                             "from test_billing_store import _write_forever; "
                             "_write_forever(sys.argv[1], float(sys.argv[2]))",
                             str(path), "0.2", str(Path(__file__).parent), *sys.path])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if path.exists() and len(summary.read([path])) > 200:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    before = summary.read([path])
    assert len(before) > 200
    newest = before["recorded_at"].astype(float).max()
    written(path, [request_row(i, "next") for i in range(3)])
    after = summary.read([path])
    assert len(after) == len(before) + 3 and after["writer"].nunique() == 2
    # Rows are committed in order: what the killed writer had committed is all there, up to
    # its newest row.
    first = after[after["writer"] == before["writer"].iloc[0]].sort_values("seq")
    assert list(first["seq"]) == list(range(len(first)))
    assert first["recorded_at"].astype(float).max() == newest


def _write_many(path: str, n: int) -> None:
    writer = LedgerWriter(path, flush_s=0.01)
    for i in range(n):
        writer.put(request_row(i, tenant=str(os.getpid())))
    writer.close()


def test_two_processes_writing_one_file_never_mix_their_rows(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    store.connect(path).close()
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_write_many, args=(str(path), 3000)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    frame = summary.read([path])
    assert len(frame) == 6000
    for _, rows in frame.groupby("writer"):
        assert sorted(rows["seq"]) == list(range(3000)) and rows["tenant"].nunique() == 1
