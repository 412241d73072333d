"""Span files read back into tables: one rank's file (`read_span_file`), an instance's ranks
merged (`SpanSet`), and collective timing across ranks (arrival, wait, transfer)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import ValidationError

from vllm_piep.spans.records import P2P_OPS, RECORD_TYPES, SCHEMA, SpanHeader


class SpanFileError(ValueError):
    pass


@dataclass
class SpanFile:
    """One rank's file as tables (one DataFrame per record kind)."""

    path: Path
    header: SpanHeader
    steps: pd.DataFrame
    modules: pd.DataFrame
    collectives: pd.DataFrame
    truncated: bool = False  # the last line was cut short (a crash) and was skipped
    resources: pd.DataFrame = field(default_factory=lambda: pd.DataFrame({"t_ns": []}))
    samples: pd.DataFrame = field(default_factory=lambda: _frame("sample", []))


_COLUMNS = {kind: [n for n, f in model.model_fields.items() if n != "kind"]
            for kind, model in RECORD_TYPES.items()}


def _frame(kind: str, rows: list[dict[str, Any]], extra: Sequence[str] = ()) -> pd.DataFrame:
    if kind == "resource":  # columns as the samples have them
        return pd.DataFrame(rows) if rows else pd.DataFrame({"t_ns": []})
    cols = [("async" if c == "async_" else c) for c in _COLUMNS[kind]] + list(extra)
    frame = pd.DataFrame(rows, columns=cols)
    return frame.rename(columns={"async": "is_async"}) if kind == "collective" else frame


def _reason(exc: Exception) -> str:
    """What is wrong with a line, short: pydantic's errors as `field: message`, joined."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}"
                         for e in exc.errors())
    return str(exc)


def _header(path: Path, obj: Any) -> SpanHeader:
    header = SpanHeader.model_validate(obj)
    if header.schema_ != SCHEMA:
        raise SpanFileError(f"{path}:1: schema {header.schema_!r}, expected {SCHEMA!r}")
    return header


def read_span_header(path: str | Path) -> SpanHeader:
    """Only the header (the first line): which rank and instance a file belongs to."""
    path = Path(path)
    with path.open("rb") as f:
        first = f.readline()
    if not first.strip():
        raise SpanFileError(f"{path}: no header line (empty file?)")
    try:
        return _header(path, json.loads(first))
    except SpanFileError:
        raise
    except Exception as exc:
        raise SpanFileError(f"{path}:1: {_reason(exc)}") from exc


def read_span_file(path: str | Path, validate: bool = True,
                   on_bad_line: Callable[[int, str], None] | None = None,
                   line_numbers: bool = False) -> SpanFile:
    """Reads one rank's file. A malformed line inside the file raises `SpanFileError` with its
    line number, or, with `on_bad_line`, is passed to it (line, reason) and skipped; a partial
    last line (a crash mid-write) is skipped and flagged. `line_numbers` adds each record's
    line as a `line` column to the step, module and collective frames."""
    path = Path(path)
    data = path.read_bytes()
    truncated = bool(data) and not data.endswith(b"\n")
    lines = data.split(b"\n")
    if truncated:
        lines = lines[:-1]
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in RECORD_TYPES}
    header: SpanHeader | None = None
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            kind = obj.get("kind")
            if number == 1:
                header = _header(path, obj)
                continue
            if kind not in RECORD_TYPES:
                raise SpanFileError(f"{path}:{number}: unknown record kind {kind!r}")
            if validate:
                RECORD_TYPES[kind].model_validate(obj)
            obj.pop("kind")
            rows[kind].append({**obj, "line": number} if line_numbers else obj)
        except Exception as exc:  # json or pydantic: name the line
            if on_bad_line is None or number == 1:
                if isinstance(exc, SpanFileError):
                    raise
                raise SpanFileError(f"{path}:{number}: {_reason(exc)}") from exc
            text = _reason(exc).replace("\n", " ")
            if isinstance(exc, SpanFileError):  # already prefixed with path:line
                text = text.split(": ", 1)[-1]
            on_bad_line(number, f"{type(exc).__name__}: {text[:300]}")
    if header is None:
        raise SpanFileError(f"{path}: no header line (empty file?)")
    extra = ("line",) if line_numbers else ()
    frames = {kind: _frame(kind, rows[kind], extra) for kind in RECORD_TYPES}
    if line_numbers:
        frames["resource"] = frames["resource"].drop(columns="line", errors="ignore")
    return SpanFile(path, header, frames["step"], frames["module"], frames["collective"],
                    truncated, resources=frames["resource"], samples=frames["sample"])


def span_files(directory: str | Path, instance: str | None = None) -> list[Path]:
    """The span files in a directory, optionally of one vLLM instance, ordered by rank."""
    paths = sorted(Path(directory).glob("*.spans.jsonl"))
    if instance is not None:
        paths = [p for p in paths if p.name.startswith(f"{instance}-")]
    return paths


@dataclass
class SpanSet:
    """The files of all ranks of one instance, with timestamps on rank 0's clock."""

    files: list[SpanFile]
    steps: pd.DataFrame
    modules: pd.DataFrame
    collectives: pd.DataFrame
    resources: pd.DataFrame = field(default_factory=lambda: pd.DataFrame({"t_ns": []}))
    samples: pd.DataFrame = field(default_factory=lambda: _frame("sample", []))

    @classmethod
    def read(cls, paths: Iterable[str | Path]) -> SpanSet:
        files = [read_span_file(p) for p in paths]
        if not files:
            raise SpanFileError("no span files given")
        instances = {f.header.instance for f in files}
        if len(instances) > 1:
            raise SpanFileError(f"span files of several vLLM instances mixed: {sorted(instances)}")
        return cls.from_files(files)

    @classmethod
    def from_files(cls, files: Sequence[SpanFile]) -> SpanSet:
        def stack(attr: str, time_cols: tuple[str, ...]) -> pd.DataFrame:
            parts = []
            for f in files:
                frame = getattr(f, attr).copy()
                frame.insert(0, "rank", f.header.rank)
                for col in time_cols:  # onto rank 0's clock
                    frame[col] = frame[col] - f.header.clock_offset_ns
                parts.append(frame)
            return pd.concat(parts, ignore_index=True)

        steps = stack("steps", ("start_ns", "end_ns"))
        modules = stack("modules", ("start_ns", "end_ns"))
        collectives = stack("collectives", ("arrival_ns", "completion_ns"))
        stage = {f.header.rank: f.header.pp_rank for f in files}
        collectives["stage"] = collectives["rank"].map(stage).astype("int64")
        collectives = collective_timing(collectives)
        return cls(list(files), steps, modules, collectives, stack("resources", ("t_ns",)),
                   stack("samples", ("start_ns", "end_ns")))


def collective_timing(collectives: pd.DataFrame) -> pd.DataFrame:
    """Adds, to the collective spans of all ranks (on one clock), each call's `last_arrival_ns`
    (the latest arrival among its participants), `participants` (how many ranks recorded it),
    and its split into `wait_ns` (own arrival to the last arrival: synchronization) and
    `transfer_ns` (last arrival to own completion: moving the data).

    A buffered send can return before its receiver arrives: that rank did not wait, and its
    whole call counts as transfer. For collectives proper, completion before the last arrival
    is impossible on one clock; `causal` flags the rows where it holds.
    """
    out = collectives.copy()
    if out.empty:
        for col in ("last_arrival_ns", "participants", "wait_ns", "transfer_ns"):
            out[col] = pd.Series(dtype="int64")
        out["causal"] = pd.Series(dtype="bool")
        return out
    p2p = out["op"].isin(P2P_OPS)
    # Participants of one call share (group, seq) for collectives and (group, pair, seq) for
    # send/recv, where the pair is the two ranks in the group in sorted order.
    me = out["rank_in_group"]
    peer = out["peer"].fillna(-1).astype("int64")
    lo = me.where(~p2p | (me < peer), peer).where(p2p, -1)
    hi = peer.where(~p2p | (me < peer), me).where(p2p, -1)
    out["_lo"], out["_hi"] = lo.astype("int64"), hi.astype("int64")
    # Every pipeline stage's tensor-parallel group has the same name ("tp:0") and counts its
    # calls from 0: the stage tells their calls apart (send/recv cross stages: not keyed).
    stage = out["stage"] if "stage" in out else pd.Series(0, index=out.index)
    out["_stage"] = stage.where(~p2p, -1).astype("int64")
    keys = ["group", "_stage", "_lo", "_hi", "seq"]
    grouped = out.groupby(keys, sort=False)
    out["last_arrival_ns"] = grouped["arrival_ns"].transform("max")
    out["participants"] = grouped["arrival_ns"].transform("size")
    out["causal"] = out["completion_ns"] >= out["last_arrival_ns"]
    effective = out["last_arrival_ns"].where(out["causal"] | ~p2p, out["arrival_ns"])
    out["wait_ns"] = effective - out["arrival_ns"]
    out["transfer_ns"] = out["completion_ns"] - effective
    return out.drop(columns=["_lo", "_hi", "_stage"])
