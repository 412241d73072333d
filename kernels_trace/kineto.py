"""torch.profiler (Kineto) Chrome traces: `prof.export_chrome_trace(path)`, plain or gzipped.

Clock: Kineto writes `ts` as microseconds with three decimals since `baseTimeNanoseconds`, the
system clock (CLOCK_REALTIME) floored to a three-month boundary; `baseTimeNanoseconds + ts` is
therefore a wall-clock time in nanoseconds, and the traces of the processes of one host are on
one clock (tests/test_kernels_trace.py checks both against `time.time_ns()` and against
collective causality). Values are parsed as decimals, so no nanosecond is lost to floats.

Which events become what (see `kernels_trace.names` for the names themselves):

- `user_annotation` ranges named by detail mode (`piep.step/N`, `piep.module/TYPE/NODE`) on CPU
  threads become step and module spans;
- a `c10d::` op on the calling thread and the gloo works it posted (matched by process, op and
  order) become one collective span: arrival at the op's start, completion at the end of its
  last work; bytes and dtype from the works' inputs (needs `record_shapes=True`). A `c10d::`
  op with no work in the trace is kept with `async` true (its completion is only the posting);
- a vLLM shared-memory op (`*::shm_allreduce`, ...) is a collective span by itself;
- an NCCL kernel on a GPU stream becomes a collective span timed by the GPU (arrival at the
  kernel's start, completion at its end) with Kineto's collective metadata; its step and node
  come from where the CPU launched it (`cuda_runtime` event with the same `correlation`);
- every kernel, memcpy and memset on the GPU (or, in a trace without GPU work, every `cpu_op`,
  with its own time) becomes a row of the kernel table, in the step and module open where it was
  launched (`kernels_trace.kernels`).
"""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from kernels_trace import names
from kernels_trace.kernels import Work, cpu_work
from kernels_trace.records import Call, GroupInfo, Interval, RankTrace, assemble, innermost

CLOCK = "CLOCK_REALTIME"
GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
DEVICE_WORK_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime"})


class KinetoTraceError(ValueError):
    pass


def _parse_float(text: str) -> float | Decimal:
    # Timestamps have up to 16 significant digits: keep those exact, the rest as floats.
    return Decimal(text) if len(text) > 15 else float(text)


def _ns(value: Any) -> int:
    """Kineto microseconds (float, Decimal or int) to integer nanoseconds."""
    if isinstance(value, Decimal):
        return int((value * 1000).to_integral_value())
    return round(float(value) * 1000)


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f, parse_float=_parse_float)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, EOFError) as exc:
        raise KinetoTraceError(f"{path}: not a readable Chrome trace: {exc}") from exc
    if isinstance(data, list):  # the bare-array Chrome trace format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise KinetoTraceError(f"{path}: no traceEvents array")
    return data


def _int(value: Any) -> int | None:
    try:
        return int(str(value).strip().strip('"'))
    except (TypeError, ValueError):
        return None


def _ranks(value: Any) -> tuple[int, ...]:
    """Group ranks as Kineto writes them: a list, or a string such as "[0, 1]"."""
    if isinstance(value, str):
        value = [v for v in value.strip().strip('"[]').split(",") if v.strip()]
    out = [_int(v) for v in value or ()]
    return tuple(v for v in out if v is not None)


def _groups(dist: Mapping[str, Any]) -> dict[str, GroupInfo]:
    groups = {}
    for pg in dist.get("pg_config") or ():
        name = str(pg.get("pg_name", ""))
        ranks = _ranks(pg.get("ranks"))
        groups[name] = GroupInfo(name=name, size=_int(pg.get("pg_size")) or len(ranks),
                                 ranks=ranks, desc=str(pg.get("pg_desc", "")))
    return groups


def _tensor_bytes(types: Any, dims: Any, index: int) -> tuple[int, str]:
    """(bytes, dtype) of argument `index` from Kineto's `Input type`/`Input Dims`; (0, "")
    when the type is no dtype (a TensorList's elements are not typed in the trace)."""
    try:
        info = names.dtype_info(types[index])
        shape = dims[index]
    except (IndexError, TypeError, KeyError):
        return 0, ""
    if info is None or not isinstance(shape, list) or any(isinstance(d, list) for d in shape):
        return 0, ""
    return math.prod(int(d) for d in shape) * info[1], info[0]


def _concrete(args: Mapping[str, Any], index: int) -> int | None:
    try:
        return _int(args["Concrete Inputs"][index])
    except (KeyError, IndexError, TypeError):
        return None


@dataclass
class _Event:
    cat: str
    name: str
    thread: tuple[Any, Any]
    start_ns: int
    end_ns: int
    args: dict[str, Any]


@dataclass
class _Caller:
    op: str
    event: _Event
    works: list[_Event]
    claimed: bool = False  # an NCCL kernel was launched inside it: the kernel is the span


def read_kineto(path: str | Path, *, rank: int | None = None,
                group_names: Mapping[str, str] | None = None,
                default_group: str | None = None, clock_offset_ns: int = 0) -> RankTrace:
    """One rank's spans from a Kineto Chrome trace. `rank` overrides the trace's
    `distributedInfo.rank`; `clock_offset_ns` is this rank's clock minus the reference rank's
    (0 on one host); `group_names` renames process groups (by name or description) and
    `default_group` names calls whose group the trace does not tell (see `assemble`)."""
    path = Path(path)
    data = load(path)
    base = _int(data.get("baseTimeNanoseconds")) or 0
    dist = data.get("distributedInfo") or {}
    if rank is None:
        rank = _int(dist.get("rank"))
    if rank is None:
        raise KinetoTraceError(f"{path}: no distributedInfo.rank (a single-process trace): "
                               "give its rank (--rank N, rank=N)")
    world = _int(dist.get("world_size")) or 1

    events: list[_Event] = []
    for raw in data["traceEvents"]:
        if not isinstance(raw, dict) or raw.get("ph") != "X" or "ts" not in raw:
            continue
        start = base + _ns(raw["ts"])
        events.append(_Event(str(raw.get("cat", "")), str(raw.get("name", "")),
                             (raw.get("pid"), raw.get("tid")), start,
                             start + _ns(raw.get("dur", 0)), raw.get("args") or {}))
    cpu = [e for e in events if e.cat not in GPU_CATS]
    pids = [e.thread[0] for e in cpu if e.cat == "cpu_op" and isinstance(e.thread[0], int)]
    trace = RankTrace(rank=rank, world_size=world, source=path, format="kineto", clock=CLOCK,
                      host=str(data.get("host_name", "")),
                      pid=max(set(pids), key=pids.count) if pids else 0,
                      groups=_groups(dist), clock_offset_ns=clock_offset_ns)

    ranges = [Interval(e.thread, e.start_ns, e.end_ns, e.name) for e in cpu
              if e.cat == "user_annotation" and e.name.startswith("piep.")]
    comms = [e for e in cpu if e.name == "record_param_comms"]
    comm_ivs = [Interval(e.thread, e.start_ns, e.end_ns, e.name) for e in comms]
    callers = [_Caller(op, e, []) for e in cpu if e.cat == "cpu_op"
               for op in [names.c10d_op(e.name)] if op]
    caller_ivs = [Interval(c.event.thread, c.event.start_ns, c.event.end_ns, c.event.name)
                  for c in callers]

    launches = _launches(cpu)
    calls = _nccl_calls(events, cpu, launches, comms, comm_ivs, callers, caller_ivs)
    trace.gpu = bool(calls)
    calls += _shm_calls(cpu)
    calls += _gloo_calls(cpu, callers, comms, caller_ivs)
    return assemble(trace, ranges, calls, group_names=group_names, default_group=default_group,
                    work=_work(events, cpu, launches))


def _launches(cpu: list[_Event]) -> dict[int, _Event]:
    """The CPU's launch of each GPU activity, by Kineto's `correlation` id."""
    launches = {}
    for e in cpu:
        if e.cat in LAUNCH_CATS and _int(e.args.get("correlation")) is not None:
            launches[_int(e.args["correlation"])] = e
    return launches


def _work(events: list[_Event], cpu: list[_Event], launches: dict[int, _Event]) -> list[Work]:
    """GPU kernels, memcpys and memsets, placed where the CPU launched them; in a trace
    without any, the CPU ops' own time (a CPU run's work), placed where they ran."""
    gpu = [e for e in events if e.cat in DEVICE_WORK_CATS]
    if gpu:
        work = []
        for e in gpu:
            launch = launches.get(_int(e.args.get("correlation")))
            work.append(Work(e.name, "gpu", e.start_ns, e.end_ns,
                             launch.thread if launch else None,
                             launch.start_ns if launch else None))
        return work
    return cpu_work([(e.thread, e.start_ns, e.end_ns, e.name) for e in cpu
                     if e.cat == "cpu_op"])


def _metadata(call: Call, args: Mapping[str, Any]) -> None:
    """Fills a call from Kineto's collective metadata (`record_param_comms` args, copied onto
    NCCL kernels)."""
    op = names.canonical_op(str(args.get("Collective name", "")))
    if op:  # more specific than a kernel's name (SendRecv, Generic)
        call.op = op
    info = names.dtype_info(args.get("dtype"))
    nelems = _int(args.get("In msg nelems"))
    if info and nelems is not None:
        call.bytes, call.dtype = nelems * info[1], info[0]
    if args.get("Process Group Name") not in (None, ""):
        call.group = str(args["Process Group Name"])
    if _int(args.get("Group size")):
        call.world_size = _int(args.get("Group size"))
    if args.get("Process Group Ranks"):
        call.group_ranks = _ranks(args["Process Group Ranks"]) or None
    peer = _int(args.get("Dst Rank")) if call.op == "send" else _int(args.get("Src Rank"))
    if peer is not None and call.op in names.P2P:
        call.peer = peer
    seq = _int(args.get("Seq"))
    if seq is not None and call.op not in names.P2P:  # NCCL counts p2p per group, not peer
        call.seq = seq


def _nccl_calls(events, cpu, launches, comms, comm_ivs, callers, caller_ivs) -> list[Call]:
    kernels = [(e, op) for e in events if e.cat == "kernel"
               for op in [names.nccl_kernel(e.name)] if op]
    if not kernels:
        return []
    by_external = {}
    for e in cpu:
        ext = _int(e.args.get("External id"))
        if ext is not None and e.cat in ("cpu_op", "user_annotation"):
            by_external.setdefault(ext, e)
    calls = []
    for kernel, op in kernels:
        launch = launches.get(_int(kernel.args.get("correlation")))
        if launch is None:  # fall back on the CPU op Kineto linked it to
            launch = by_external.get(_int(kernel.args.get("External id")))
        call = Call(op=op, arrival_ns=kernel.start_ns, completion_ns=kernel.end_ns,
                    thread=launch.thread if launch else None,
                    anchor_ns=launch.start_ns if launch else None,
                    dtype=names.kernel_dtype(kernel.name) or "", source=kernel.name)
        calls.append(call)
    # Metadata from the record_param_comms around the launch, then the kernel's own copy.
    points = [(c.thread, c.anchor_ns) for c in calls]
    for call, (kernel, _), idx in zip(calls, kernels, innermost(comm_ivs, points)):
        if idx is not None:
            _metadata(call, comms[idx].args)
        _metadata(call, kernel.args)
    for idx in innermost(caller_ivs, points):
        if idx is not None:
            callers[idx].claimed = True
    return calls


def _shm_calls(cpu) -> list[Call]:
    calls = []
    for e in cpu:
        op = names.shm_op(e.name) if e.cat == "cpu_op" else None
        if not op:
            continue
        size, dtype = _tensor_bytes(e.args.get("Input type"), e.args.get("Input Dims"),
                                    names.SHM_DATA_ARG)
        peer = _concrete(e.args, names.SHM_PEER_ARG[op]) if op in names.SHM_PEER_ARG else None
        calls.append(Call(op=op, arrival_ns=e.start_ns, completion_ns=e.end_ns,
                          thread=e.thread, anchor_ns=e.start_ns, bytes=size, dtype=dtype,
                          peer=peer, source=e.name))
    return calls


def _gloo_calls(cpu, callers: list[_Caller], comms, caller_ivs) -> list[Call]:
    works = sorted(((e, op) for e in cpu if e.cat == "user_annotation"
                    for op in [names.gloo_op(e.name)] if op), key=lambda w: w[0].start_ns)
    # gloo queues works in call order and its workers take them in that order: the n-th work
    # of an op belongs to the n-th unserved caller of a compatible op in that process that
    # started before it; a work with no such caller belongs to the last served one if that
    # one runs as several works (gloo's reduce-scatter), else it stands alone.
    open_callers = [c for c in sorted(callers, key=lambda c: c.event.start_ns)
                    if not c.claimed]
    queues: dict[tuple[Any, str], list[_Caller]] = defaultdict(list)
    next_of: dict[tuple[Any, str], int] = defaultdict(int)
    for caller in open_callers:
        for work_op in set(names.GLOO_SERVES) | {caller.op}:
            if names.gloo_serves(work_op, caller.op):
                queues[(caller.event.thread[0], work_op)].append(caller)
    orphans = []
    for work, op in works:
        key = (work.thread[0], op)
        queue, i = queues.get(key, []), next_of[key]
        if i < len(queue) and queue[i].event.start_ns <= work.start_ns:
            queue[i].works.append(work)
            next_of[key] = i + 1
            continue
        last = queue[i - 1] if 0 < i <= len(queue) else None
        if last and (last.op == "reduce_scatter" or "coalesced" in last.event.name):
            last.works.append(work)
        else:
            orphans.append((work, op))

    meta = {}  # record_param_comms inside a caller (newer backends may emit it on CPU)
    for comm, idx in zip(comms, innermost(caller_ivs, [(e.thread, e.start_ns) for e in comms])):
        if idx is not None:
            meta.setdefault(idx, comm.args)
    calls = []
    for idx, caller in enumerate(callers):
        if caller.claimed:
            continue
        e = caller.event
        call = Call(op=caller.op, arrival_ns=e.start_ns,
                    completion_ns=max([e.end_ns] + [w.end_ns for w in caller.works]),
                    thread=e.thread, anchor_ns=e.start_ns, async_=not caller.works,
                    source=e.name)
        if caller.op in names.P2P:
            call.peer = _concrete(e.args, 2)
        _work_bytes(call, caller.works)
        if idx in meta:
            _metadata(call, meta[idx])
        calls.append(call)
    for work, op in orphans:
        call = Call(op=op, arrival_ns=work.start_ns, completion_ns=work.end_ns,
                    source=work.name)
        _work_bytes(call, [work])
        calls.append(call)
    return calls


def _work_bytes(call: Call, works: list[_Event]) -> None:
    total, dtype = 0, ""
    for work in works:
        size, kind = _tensor_bytes(work.args.get("Input type"), work.args.get("Input Dims"), 0)
        total += size
        dtype = dtype or kind
    if call.op == "barrier":
        total, dtype = 0, ""
    call.bytes, call.dtype = total, dtype
