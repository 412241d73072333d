"""From what a trace reader found (detail-mode ranges and collective calls, on threads) to one
rank's span records: enclosing step and module of every call, group, rank in group, sequence
numbers. Format-independent: the Kineto and Nsight readers both end here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel

from kernels_trace.kernels import KERNEL_COLUMNS, Work, empty_frame
from vllm_piep.spans.reader import SpanFile
from vllm_piep.spans.records import (
    P2P_OPS,
    CollectiveSpan,
    ModuleSpan,
    SpanHeader,
    StepSpan,
    parse_range_name,
)

Thread = Hashable  # (pid, tid) in Kineto traces, globalTid in Nsight exports


@dataclass(frozen=True)
class Interval:
    """One range on one CPU thread, in nanoseconds on the trace's clock."""

    thread: Thread
    start_ns: int
    end_ns: int
    name: str


@dataclass
class Call:
    """One collective call as a reader found it. `thread` and `anchor_ns` say where the caller
    was when it made the call (the ranges open there at that time enclose it); None when the
    trace does not tell. Unknown sizes are 0 bytes with an empty dtype."""

    op: str
    arrival_ns: int
    completion_ns: int
    thread: Thread | None = None
    anchor_ns: int | None = None
    bytes: int = 0
    dtype: str = ""
    group: str | None = None  # the process group's name as the trace has it
    world_size: int | None = None
    rank_in_group: int | None = None
    group_ranks: tuple[int, ...] | None = None
    peer: int | None = None
    seq: int | None = None
    async_: bool = False
    source: str = ""  # the trace event it came from, for diagnostics


@dataclass(frozen=True)
class GroupInfo:
    """A process group as the trace's metadata describes it."""

    name: str
    size: int
    ranks: tuple[int, ...] = ()
    desc: str = ""


@dataclass
class RankTrace:
    """One rank's span records read from a trace. Timestamps are nanoseconds on `clock`;
    `clock_offset_ns` is this rank's clock minus the reference rank's (0 on one host)."""

    rank: int
    world_size: int
    source: Path
    format: str  # kineto | nsys
    clock: str
    host: str = ""
    pid: int = 0
    steps: list[StepSpan] = field(default_factory=list)
    modules: list[ModuleSpan] = field(default_factory=list)
    collectives: list[CollectiveSpan] = field(default_factory=list)
    groups: dict[str, GroupInfo] = field(default_factory=dict)
    clock_offset_ns: int = 0
    gpu: bool = False  # collectives timed by GPU kernels
    kernels: pd.DataFrame = field(default_factory=empty_frame)  # `kernels.KERNEL_COLUMNS`

    def header(self, instance: str = "kernels_trace") -> SpanHeader:
        return SpanHeader(rank=self.rank, world_size=self.world_size, host=self.host,
                          pid=self.pid, clock=self.clock, clock_offset_ns=self.clock_offset_ns,
                          instance=instance, mode="detail", realtime_offset_ns=0,
                          timer="nsys" if self.format == "nsys" else "kineto")

    def records(self) -> list[dict]:
        """The `piep.spans/1` records (steps, modules, collectives) as JSON-ready dicts."""
        return [r.model_dump(by_alias=True) for r in (*self.steps, *self.modules,
                                                       *self.collectives)]

    def span_file(self, instance: str = "kernels_trace") -> SpanFile:
        """The records as `spans.reader` reads a span file, ready for `SpanSet.from_files`."""
        return SpanFile(self.source, self.header(instance), _frame(StepSpan, self.steps),
                        _frame(ModuleSpan, self.modules),
                        _frame(CollectiveSpan, self.collectives))


def _frame(model: type[BaseModel], records: Sequence[BaseModel]) -> pd.DataFrame:
    cols = [n for n in model.model_fields if n != "kind"]
    frame = pd.DataFrame([r.model_dump(exclude={"kind"}) for r in records], columns=cols)
    return frame.rename(columns={"async_": "is_async"})


def innermost(intervals: Sequence[Interval], points: Sequence[tuple[Thread, int]]
              ) -> list[int | None]:
    """For each (thread, time) point, the index of the innermost interval on that thread that
    contains it (bounds included; the latest-opened one when ranges overlap), else None.
    One sweep per thread."""
    result: list[int | None] = [None] * len(points)
    by_thread: dict[Thread, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for i, iv in enumerate(intervals):
        by_thread[iv.thread][0].append(i)
    for j, (thread, _) in enumerate(points):
        if thread is not None:
            by_thread[thread][1].append(j)
    for ivs, pts in by_thread.values():
        if not ivs or not pts:
            continue
        # Opens before points before closes at one time; the outer range opens first and the
        # inner one closes first.
        events = [(intervals[i].start_ns, 0, -intervals[i].end_ns, i) for i in ivs]
        events += [(intervals[i].end_ns, 2, -intervals[i].start_ns, i) for i in ivs]
        events += [(points[j][1], 1, 0, j) for j in pts]
        events.sort()
        stack: list[int] = []
        for _, kind, _, idx in events:
            if kind == 0:
                stack.append(idx)
            elif kind == 1:
                result[idx] = stack[-1] if stack else None
            elif stack and stack[-1] == idx:
                stack.pop()
            else:
                stack.remove(idx)
    return result


def assemble(trace: RankTrace, ranges: Sequence[Interval], calls: Sequence[Call], *,
             group_names: Mapping[str, str] | None = None,
             default_group: str | None = None, work: Sequence[Work] = ()) -> RankTrace:
    """Fills `trace` with the step, module and collective records of `ranges` (detail-mode
    range names; others are ignored) and `calls`, and its kernel table with `work`, each
    kernel in the step and module open where it was launched.

    A call's group is the trace's process-group name, renamed through `group_names` (keys: a
    group's name or description); calls without one get `default_group`, else the trace's only
    process group, else `unknown`. Its `seq` is the trace's own sequence number when it has one,
    else the call's index, in arrival order, among this rank's calls in that group (with that
    peer for send/recv): equal across ranks when every rank's trace starts at the same call."""
    group_names = dict(group_names or {})
    parsed = [(iv, parse_range_name(iv.name)) for iv in ranges]
    step_ivs = [iv for iv, p in parsed if p and p[0] == "step"]
    module_ivs = [(iv, p[1]) for iv, p in parsed if p and p[0] == "module"]
    step_of = {id(iv): parse_range_name(iv.name)[1]["step"] for iv in step_ivs}

    def step_at(points: list[tuple[Thread, int]]) -> list[int]:
        found = innermost(step_ivs, points)
        return [-1 if i is None else step_of[id(step_ivs[i])] for i in found]

    trace.steps = [StepSpan(step=step_of[id(iv)], start_ns=iv.start_ns, end_ns=iv.end_ns,
                            prefill_tokens=0, decode_tokens=0, num_reqs=0)
                   for iv in sorted(step_ivs, key=lambda iv: iv.start_ns)]
    module_ivs.sort(key=lambda m: (m[0].start_ns, -m[0].end_ns))
    module_steps = step_at([(iv.thread, iv.start_ns) for iv, _ in module_ivs])
    trace.modules = [ModuleSpan(step=s, node=info["node"], type=info["type"],
                                layer=info["layer"], start_ns=iv.start_ns, end_ns=iv.end_ns,
                                prefill_tokens=0, decode_tokens=0)
                     for (iv, info), s in zip(module_ivs, module_steps)]

    ordered = sorted(calls, key=lambda c: (c.arrival_ns, c.completion_ns))
    points = [(c.thread, c.arrival_ns if c.anchor_ns is None else c.anchor_ns)
              for c in ordered]
    call_steps = step_at(points)
    only_modules = [iv for iv, _ in module_ivs]
    call_nodes = [None if i is None else module_ivs[i][1]["node"]
                  for i in innermost(only_modules, points)]
    fallback = default_group or (next(iter(trace.groups)) if len(trace.groups) == 1
                                 else "unknown")
    counters: dict[tuple, int] = defaultdict(int)
    spans = []
    for call, step, node in zip(ordered, call_steps, call_nodes):
        name = call.group if call.group is not None else fallback
        info = trace.groups.get(name)
        label = group_names.get(name) or (info and group_names.get(info.desc)) or name
        ranks = call.group_ranks or (info.ranks if info else ())
        world = call.world_size or (info.size if info else None) or len(ranks) or \
            trace.world_size
        if call.rank_in_group is not None:
            me = call.rank_in_group
        elif ranks and trace.rank in ranks:
            me = ranks.index(trace.rank)
        else:
            me = trace.rank
        peer = call.peer if call.op in P2P_OPS else None
        if call.seq is not None:
            seq = call.seq
        else:
            key = (label, peer) if call.op in P2P_OPS else (label,)
            seq = counters[key]
            counters[key] += 1
        spans.append(CollectiveSpan(
            step=step, op=call.op, group=label, world_size=world, rank_in_group=me, peer=peer,
            seq=seq, bytes=call.bytes, dtype=call.dtype, arrival_ns=call.arrival_ns,
            completion_ns=max(call.completion_ns, call.arrival_ns), node=node,
            async_=call.async_))
    trace.collectives = spans
    trace.kernels = _kernel_frame(trace.rank, work, step_at, module_ivs)
    return trace


def _kernel_frame(rank: int, work: Sequence[Work], step_at: Any,
                  module_ivs: list[tuple[Interval, dict]]) -> pd.DataFrame:
    if not work:
        return empty_frame()
    points = [(w.thread, w.start_ns if w.anchor_ns is None else w.anchor_ns) for w in work]
    steps = step_at(points)
    nodes = innermost([iv for iv, _ in module_ivs], points)
    rows = []
    for w, step, idx in zip(work, steps, nodes, strict=True):
        info = None if idx is None else module_ivs[idx][1]
        rows.append((rank, step, None if info is None else info["node"],
                     None if info is None else info["type"],
                     None if info is None else info["layer"], w.name, w.device,
                     w.start_ns, w.end_ns, w.ns))
    return pd.DataFrame(rows, columns=list(KERNEL_COLUMNS))
