"""Span files: written off the step loop, read back after a crash, and the wait/transfer split
of collectives across ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_piep.spans.reader import (
    SpanFileError,
    SpanSet,
    collective_timing,
    read_span_file,
    span_files,
)
from vllm_piep.spans.records import SpanHeader, estimate_clock_offset, parse_range_name
from vllm_piep.spans.writer import SpanWriter


def header(rank: int = 0, **kw: object) -> SpanHeader:
    return SpanHeader(rank=rank, world_size=2, host="h", pid=1, instance="i1", **kw)


def step(n: int, start: int = 0, end: int = 10) -> dict:
    return {"kind": "step", "step": n, "start_ns": start, "end_ns": end, "prefill_tokens": 3,
            "decode_tokens": 1, "num_reqs": 2}


def coll(rank: int, arrival: int, completion: int, seq: int = 0, op: str = "all_reduce",
         peer: int | None = None, group: str = "tp:0") -> dict:
    return {"kind": "collective", "step": 0, "op": op, "group": group, "world_size": 2,
            "rank_in_group": rank, "peer": peer, "seq": seq, "bytes": 64, "dtype": "float32",
            "arrival_ns": arrival, "completion_ns": completion, "node": None, "async": False}


def test_writer_round_trip_with_records_built_on_its_thread(tmp_path: Path) -> None:
    path = tmp_path / "i1-rank000.spans.jsonl"
    writer = SpanWriter(path, header(), flush_interval_s=0.01)
    built_on: list[str] = []

    def later() -> list[dict]:
        built_on.append(threading.current_thread().name)
        return [step(1), coll(0, 1, 2)]

    writer.put(step(0))
    writer.put(later)
    writer.close()
    assert built_on == ["piep-span-writer"] or built_on == ["MainThread"]  # thread or close()
    span = read_span_file(path)
    assert span.header.instance == "i1" and not span.truncated
    assert list(span.steps["step"]) == [0, 1]
    assert span.collectives.loc[0, "is_async"] == False
    assert writer.written == 3 and writer.failures == 0
    assert not any(t.name == "piep-span-writer" for t in threading.enumerate())


def test_a_step_that_cannot_be_built_is_counted_and_the_rest_still_written(
        tmp_path: Path) -> None:
    writer = SpanWriter(tmp_path / "a.spans.jsonl", header())
    writer.put(lambda: [1 / 0])  # type: ignore[list-item]
    writer.put(step(5))
    writer.close()
    assert writer.failures == 1
    assert list(read_span_file(tmp_path / "a.spans.jsonl").steps["step"]) == [5]


def test_file_cut_by_a_crash_is_read_up_to_its_last_complete_record(tmp_path: Path) -> None:
    # A real crash: a process writes records, then dies by SIGKILL in the middle of a line.
    path = tmp_path / "crash.spans.jsonl"
    code = f"""
import os, json, signal
from vllm_piep.spans.records import SpanHeader
from vllm_piep.spans.writer import SpanWriter
w = SpanWriter({str(path)!r}, SpanHeader(rank=0, world_size=1, host="h", pid=os.getpid()))
for i in range(100):
    w.put({{"kind": "step", "step": i, "start_ns": i, "end_ns": i + 1, "prefill_tokens": 1,
           "decode_tokens": 0, "num_reqs": 1}})
w.flush()
os.write(w._fd, b'{{"kind": "step", "step": 100, "sta')
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -9
    span = read_span_file(path)
    assert span.truncated
    assert list(span.steps["step"]) == list(range(100))


def test_malformed_line_inside_a_file_is_named_by_line_number(tmp_path: Path) -> None:
    path = tmp_path / "bad.spans.jsonl"
    lines = [header().model_dump_json(by_alias=True), json.dumps(step(0)),
             json.dumps({**step(1), "end_ns": "soon"}), json.dumps(step(2))]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpanFileError, match=r"bad.spans.jsonl:3"):
        read_span_file(path)
    path.write_text(json.dumps({**json.loads(lines[0]), "schema": "piep.spans/0"}) + "\n")
    with pytest.raises(SpanFileError, match="schema"):
        read_span_file(path)


def _frame(rows: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame([{k: v for k, v in r.items() if k != "kind"} for r in rows])
    frame.insert(0, "rank", frame["rank_in_group"])
    return frame.rename(columns={"async": "is_async"})


def test_wait_is_up_to_the_last_arrival_and_transfer_after_it() -> None:
    timed = collective_timing(_frame([coll(0, 100, 400), coll(1, 300, 410),
                                      coll(0, 500, 600, seq=1), coll(1, 450, 620, seq=1)]))
    assert list(timed["wait_ns"]) == [200, 0, 0, 50]
    assert list(timed["transfer_ns"]) == [100, 110, 100, 120]
    assert timed["causal"].all() and (timed["participants"] == 2).all()


def test_buffered_send_that_returns_before_its_receiver_arrives_never_waits() -> None:
    timed = collective_timing(_frame([
        coll(0, 100, 150, op="send", peer=1, group="pp:0"),
        coll(1, 300, 400, op="recv", peer=0, group="pp:0"),   # arrived late: no wait
        coll(0, 500, 520, seq=1, op="send", peer=1, group="pp:0"),
        coll(1, 450, 560, seq=1, op="recv", peer=0, group="pp:0"),  # waited for the sender
    ]))
    assert list(timed["wait_ns"]) == [0, 0, 0, 50]
    assert list(timed["transfer_ns"]) == [50, 100, 20, 60]


@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), min_size=2,
                max_size=6))
def test_wait_plus_transfer_is_the_whole_call(calls: list[tuple[int, int]]) -> None:
    # Ranks of one collective: any arrivals; completions after every arrival.
    last = max(a for a, _ in calls)
    rows = [coll(r, a, last + d) for r, (a, d) in enumerate(calls)]
    for r in rows:
        r["world_size"] = len(rows)
    timed = collective_timing(_frame(rows))
    assert (timed["wait_ns"] >= 0).all() and (timed["transfer_ns"] >= 0).all()
    assert ((timed["wait_ns"] + timed["transfer_ns"])
            == timed["completion_ns"] - timed["arrival_ns"]).all()
    assert (timed["arrival_ns"] + timed["wait_ns"] == last).all()


def test_ranks_of_other_hosts_are_put_on_rank_0s_clock(tmp_path: Path) -> None:
    for rank, offset, arrival in ((0, 0, 100), (1, 5_000, 5_300)):  # rank 1's clock is ahead
        w = SpanWriter(tmp_path / f"i1-dp0-rank00{rank}.spans.jsonl",
                       header(rank, clock_offset_ns=offset))
        w.put(coll(rank, arrival, arrival + 400))
        w.close()
    spans = SpanSet.read(span_files(tmp_path))
    assert list(spans.collectives["arrival_ns"]) == [100, 300]
    assert list(spans.collectives["wait_ns"]) == [200, 0]


def test_files_of_two_instances_are_not_mixed(tmp_path: Path) -> None:
    for instance in ("a", "b"):
        SpanWriter(tmp_path / f"{instance}-dp0-rank000.spans.jsonl",
                   SpanHeader(rank=0, world_size=1, host="h", pid=1, instance=instance)).close()
    assert len(span_files(tmp_path, "a")) == 1
    with pytest.raises(SpanFileError, match="several vLLM instances"):
        SpanSet.read(span_files(tmp_path))


def test_clock_offset_estimate_uses_the_shortest_round_trip() -> None:
    remote_ahead = 1_000_000
    samples = [(0, 500 + remote_ahead + 300, 1000),  # slow reply, skewed
               (2000, 2050 + remote_ahead, 2100),   # fastest: 100 ns round trip
               (3000, 3400 + remote_ahead, 3900)]
    offset, error = estimate_clock_offset(samples)
    assert offset == remote_ahead and error == 50


def test_profiler_range_names_round_trip() -> None:
    from vllm_piep.spans.records import module_range_name, step_range_name

    assert parse_range_name(step_range_name(7)) == ("step", {"step": 7})
    assert parse_range_name(module_range_name("mlp", "layers.3.mlp")) == \
        ("module", {"type": "mlp", "node": "layers.3.mlp", "layer": 3})
    assert parse_range_name(module_range_name("logits", "logits"))[1]["layer"] is None
    assert parse_range_name("aten::mm") is None


def test_show_cli_refuses_a_missing_path_with_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "vllm_piep.spans", "show",
                           str(tmp_path / "nope")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 2 and "no such file" in proc.stderr
