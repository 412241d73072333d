"""Span records: what one rank did in each engine step, written to one append-only JSONL file
per rank and read back into tables. No vLLM imports.

Schema `piep.spans/1` (one JSON object per line, `kind` names the record):

- `header` (first line): rank layout (`rank`, `world_size`, `tp_rank`/`tp_size`, `pp_rank`/
  `pp_size`, `dp_rank`/`dp_size`), `host`, `boot_id`, `pid`, `clock` (the clock of every
  timestamp in the file, in ns: CLOCK_MONOTONIC for the plugin's files, CLOCK_REALTIME for files
  made from profiler traces by kernels_trace), `realtime_offset_ns` (CLOCK_REALTIME minus
  CLOCK_MONOTONIC when the file was opened, to line a plugin file up with a trace),
  `clock_offset_ns` (this rank's clock minus rank 0's; 0 when both share a host) and
  `clock_offset_error_ns`, `instance` (shared by the ranks of one vLLM instance), `model`,
  `architecture`, `dtype`, `shape` (the `flops.ModelShape` fields, from which each module's
  FLOPs and bytes in a step follow), `mode` (`step` or `detail`), `timer` (`perf_counter_ns`,
  `cuda_event`, or the trace format `kineto`/`nsys`) and `tree` (the rank's `ModelTree`,
  detail mode only).
- `step`: `step` (the worker's step index, equal on every rank of an instance), `start_ns`,
  `end_ns`, `prefill_tokens`, `decode_tokens`, `num_reqs`, and the sums that module work depends
  on (`flops.StepTotals`): `context_tokens` (cached tokens before the step, over requests),
  `attended_pairs` (causal query-key pairs), `sampled_rows` (rows sent to the LM head).
- `resource`: `t_ns` and the rank's resource features at that time (`vllm_piep.resources`:
  `cpu_util`, `cpu_mem_util`, `cpu_clock_mhz`, `process_rss_bytes`, and on GPUs `gpu_util`,
  `gpu_mem_util`, `gpu_clock_mhz`, `gpu_mem_clock_mhz`, `gpu_mem_bytes`), written when
  `resource_interval_s` is set.
- `module`: `step`, `node` (a `ModelTree` node id), `type`, `layer` (or null), `start_ns`,
  `end_ns`, `prefill_tokens`, `decode_tokens`.
- `collective`: `step`, `op`, `group` (vLLM's group name, e.g. `tp:0`), `world_size`,
  `rank_in_group`, `peer` (the other rank in the group for send/recv, else null), `seq` (the
  call's index among this rank's calls in that group, or with that peer for send/recv: equal on
  every participant of one collective), `bytes`, `dtype`, `arrival_ns` (entry), `completion_ns`
  (return), `node` (the module node the call ran inside, or null) and `async` (true when the call
  only posts the transfer, so that completion is the posting time).
- `sample` (repeated sampling, `vllm_piep.replay`; detail mode with `sampling`): one meter
  window of `calls` back-to-back runs of a module (`target` `module`, `node`) or of a
  collective (`target` `collective`: `op`, `group`, `seq` name the recorded call it repeats,
  `node` the module it ran inside), `window` (its index in the step), `start_ns`, `end_ns`.
  A sampled step's `step` record has `replay_ns`: the time the replays added to it.
  Every `step` record has `worker_ns`: the step time the worker sends the engine, which the
  serve path's predictor reads (the worker's own calls, without the gap between them).

A file cut short by a crash is readable up to its last complete line.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from vllm_piep.once import logger

SCHEMA = "piep.spans/1"

now_ns = time.perf_counter_ns  # CLOCK_MONOTONIC on Linux, shared by all processes of a host


class SpanHeader(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["header"] = "header"
    schema_: str = Field(SCHEMA, alias="schema")
    rank: int
    world_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    host: str
    boot_id: str = ""
    pid: int
    clock: str = "CLOCK_MONOTONIC"
    realtime_offset_ns: int = Field(default_factory=lambda: time.time_ns() - now_ns())
    clock_offset_ns: int = 0
    clock_offset_error_ns: int = 0
    instance: str = ""
    model: str = ""
    architecture: str = ""
    dtype: str = ""
    shape: dict[str, Any] | None = None
    mode: Literal["step", "detail"] = "step"
    timer: Literal["perf_counter_ns", "cuda_event", "kineto", "nsys"] = "perf_counter_ns"
    tree: dict[str, Any] | None = None


class StepSpan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["step"] = "step"
    step: int
    start_ns: int
    end_ns: int
    prefill_tokens: int
    decode_tokens: int
    num_reqs: int
    context_tokens: int = 0
    attended_pairs: int = 0
    sampled_rows: int = 0
    replay_ns: int = 0  # time spent in repeated sampling inside this step (0: not sampled)
    worker_ns: int = 0  # the step time sent to the engine (the serve path's `step_seconds`)


class ModuleSpan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["module"] = "module"
    step: int
    node: str
    type: str
    layer: int | None
    start_ns: int
    end_ns: int
    prefill_tokens: int
    decode_tokens: int


class CollectiveSpan(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: Literal["collective"] = "collective"
    step: int
    op: str
    group: str
    world_size: int
    rank_in_group: int
    peer: int | None
    seq: int
    bytes: int
    dtype: str
    arrival_ns: int
    completion_ns: int
    node: str | None
    async_: bool = Field(False, alias="async")


class ResourceSample(BaseModel):
    """One sample of the rank's resource features (`vllm_piep.resources`): feature columns vary
    with the hardware (CPU only, or with GPU features)."""

    model_config = ConfigDict(extra="allow")

    kind: Literal["resource"] = "resource"
    t_ns: int


class SampleSpan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["sample"] = "sample"
    step: int
    target: Literal["module", "collective"]
    node: str | None
    op: str | None = None
    group: str | None = None
    seq: int | None = None
    calls: int = Field(ge=1)
    window: int = Field(ge=0)
    start_ns: int
    end_ns: int


RECORD_TYPES: dict[str, type[BaseModel]] = {
    "step": StepSpan, "module": ModuleSpan, "collective": CollectiveSpan,
    "resource": ResourceSample, "sample": SampleSpan,
}
P2P_OPS = frozenset({"send", "recv"})


def header_json(header: SpanHeader) -> str:
    return header.model_dump_json(by_alias=True)


class SpanWriter:
    """Appends records to one JSONL file from a background thread, so that the step loop only
    appends a dict to a deque. Whole lines go out in one `write` with O_APPEND: a crash leaves at
    most one partial last line, which the reader skips."""

    def __init__(self, path: str | Path, header: SpanHeader, flush_interval_s: float = 0.2):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self._fd, (header_json(header) + "\n").encode())
        # Dicts, or callables returning lists of dicts: turning a step into records (and
        # resolving GPU events) happens here, off the step loop.
        self._pending: deque[dict[str, Any] | Callable[[], list[dict[str, Any]]]] = deque()
        self._interval = flush_interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.written = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="piep-span-writer", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, SpanWriter._close_quietly, weakref.ref(self))
        atexit.register(self.close)

    def put(self, record: dict[str, Any] | Callable[[], list[dict[str, Any]]]) -> None:
        self._pending.append(record)  # deque.append is atomic: no lock on the hot path

    def flush(self) -> None:
        with self._lock:
            if self._fd < 0:
                return
            lines = []
            while self._pending:
                item = self._pending.popleft()
                try:
                    records = item() if callable(item) else (item,)
                    lines.extend(json.dumps(r, separators=(",", ":")) for r in records)
                except Exception as exc:  # one bad step must not stop the file
                    self.failures += 1
                    if self.failures == 1:
                        logger.warning("vllm_piep: could not write a step's spans to %s "
                                       "(%s: %s); skipping such steps", self.path,
                                       type(exc).__name__, exc, exc_info=exc)
            if lines:
                os.write(self._fd, ("\n".join(lines) + "\n").encode())
                self.written += len(lines)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.flush()
        with self._lock:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        atexit.unregister(self.close)

    @staticmethod
    def _close_quietly(ref: weakref.ref[SpanWriter]) -> None:
        writer = ref()
        if writer is not None:
            writer.close()


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
        raise SpanFileError(f"{path}:1: {exc}") from exc


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
                raise SpanFileError(f"{path}:{number}: {exc}") from exc
            text = str(exc).replace("\n", " ")
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


def read_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def estimate_clock_offset(samples: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """Cristian's estimate of (remote clock - local clock) from ping-pong samples
    (local send, remote reply time, local receive): the sample with the shortest round trip
    wins; its error bound is half that round trip."""
    if not samples:
        raise ValueError("no clock samples")
    t0, remote, t1 = min(samples, key=lambda s: s[2] - s[0])
    if t1 < t0:
        raise ValueError("clock sample with negative round trip")
    return remote - (t0 + t1) // 2, (t1 - t0 + 1) // 2


# Names of the torch.profiler ranges that detail mode opens (`record_function`) while a profiler
# is on, so that a Kineto or Nsight trace can be cut into the same spans (see kernels_trace).
STEP_RANGE = "piep.step"
MODULE_RANGE = "piep.module"


def step_range_name(step: int) -> str:
    return f"{STEP_RANGE}/{step}"


def module_range_name(node_type: str, node: str) -> str:
    return f"{MODULE_RANGE}/{node_type}/{node}"


def parse_range_name(name: str) -> tuple[str, dict[str, Any]] | None:
    """('step', {'step': n}) or ('module', {'type': t, 'node': id, 'layer': i|None}) for a
    detail-mode range name, None for anything else."""
    if name.startswith(STEP_RANGE + "/"):
        tail = name[len(STEP_RANGE) + 1:]
        return ("step", {"step": int(tail)}) if tail.isdigit() else None
    if name.startswith(MODULE_RANGE + "/"):
        node_type, _, node = name[len(MODULE_RANGE) + 1:].partition("/")
        if not node:
            return None
        return "module", {"type": node_type, "node": node, "layer": layer_of(node)}
    return None


def layer_of(node: str) -> int | None:
    """The layer index in a node id such as `layers.3.mlp`, else None."""
    parts = node.split(".")
    if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1])
    return None


if __name__ == "__main__":
    import sys

    from vllm_piep.spans_cli import main

    sys.exit(main())
