"""Nsight Systems SQLite exports (`nsys export --type sqlite report.nsys-rep`).

Tables read (the standard export layout; timestamps are nanoseconds since the session start):

- `NVTX_EVENTS` (`start`, `end`, `eventType`, `text` or `textId` -> `StringIds`, `globalTid`):
  push/pop and start/end ranges. Detail mode's names (`piep.step/N`, `piep.module/TYPE/NODE`)
  become step and module spans; with `torch.autograd.profiler.emit_nvtx` a range's text carries
  a `, seq = ...` tail, which is cut. NCCL's own ranges (`ncclAllReduce`, `ncclSend`, ...) name
  the op of generic kernels.
- `CUPTI_ACTIVITY_KIND_KERNEL` (`start`, `end`, `correlationId`, `globalPid`, `deviceId`,
  `shortName`/`demangledName` -> `StringIds`): NCCL kernels (`ncclDevKernel_AllReduce_*`,
  `ncclKernel_*`) become collective spans timed by the GPU; every kernel becomes a row of the
  kernel table (`kernels_trace.kernels`).
- `CUPTI_ACTIVITY_KIND_RUNTIME` (`start`, `globalTid`, `correlationId`): the launch of each
  kernel, so that its step and node are the ranges open on the launching thread.
- `TARGET_INFO_SESSION_START_TIME` (`utcEpochNs`): added to every timestamp, so that spans are
  UTC nanoseconds (CLOCK_REALTIME) like Kineto's; without it they stay session-relative.
- `TARGET_INFO_SYSTEM_ENV` (`name` = `Hostname`), when present.

`globalTid`/`globalPid` hold the process id in bits 24-47 (the export's serialisation). One
report may hold several processes (`nsys profile torchrun ...`): each process with NCCL kernels
or detail-mode ranges is one rank (in a report with neither, each process with kernels). The
export does not record message sizes or process groups: bytes are 0 and the group is
`default_group` (or `nccl`).
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from kernels_trace import names
from kernels_trace.kernels import Work
from kernels_trace.records import Call, Interval, RankTrace, assemble, innermost

RANGE_EVENT_TYPES = (59, 60)  # NvtxPushPopRange, NvtxStartEndRange


class NsysExportError(ValueError):
    pass


def pid_of(global_id: int) -> int:
    return (int(global_id) >> 24) & 0xFFFFFF


def _tables(db: sqlite3.Connection) -> dict[str, set[str]]:
    out = {}
    for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
        out[table] = {row[1] for row in db.execute(f"PRAGMA table_info('{table}')")}
    return out


def read_nsys(path: str | Path, *, rank: int | None = None,
              ranks: Mapping[int, int] | None = None, world_size: int | None = None,
              group_names: Mapping[str, str] | None = None, default_group: str = "nccl",
              clock_offsets_ns: Mapping[int, int] | None = None) -> list[RankTrace]:
    """The ranks in one Nsight Systems SQLite export, one `RankTrace` per process. `ranks`
    maps process ids to ranks; by default processes are ranked by the lowest GPU their
    kernels ran on, then by process id. `rank` names the rank of a single-process report."""
    path = Path(path)
    if not path.exists():
        raise NsysExportError(f"{path}: no such file")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return _read(db, path, rank, ranks, world_size, group_names, default_group,
                     clock_offsets_ns or {})
    except sqlite3.DatabaseError as exc:
        raise NsysExportError(f"{path}: {exc}") from exc
    finally:
        db.close()


def _read(db, path, rank, ranks, world_size, group_names, default_group, offsets):
    tables = _tables(db)
    strings = dict(db.execute("SELECT id, value FROM StringIds")) if "StringIds" in tables \
        else {}
    base, clock = 0, "nsys session"
    if "TARGET_INFO_SESSION_START_TIME" in tables:
        row = db.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME").fetchone()
        if row and row[0] is not None:
            base, clock = int(row[0]), "CLOCK_REALTIME"
    host = ""
    if "TARGET_INFO_SYSTEM_ENV" in tables:
        row = db.execute("SELECT value FROM TARGET_INFO_SYSTEM_ENV WHERE name = 'Hostname'"
                         ).fetchone()
        host = row[0] if row else ""

    ranges: dict[int, list[Interval]] = defaultdict(list)
    nccl_ranges: dict[int, list[Interval]] = defaultdict(list)
    if "NVTX_EVENTS" in tables:
        cols = tables["NVTX_EVENTS"]
        text = "text" if "text" in cols else "NULL"
        text_id = "textId" if "textId" in cols else "NULL"
        query = (f"SELECT start, end, {text}, {text_id}, globalTid FROM NVTX_EVENTS "
                 f"WHERE end IS NOT NULL AND end >= start")
        if "eventType" in cols:
            query += f" AND eventType IN {RANGE_EVENT_TYPES}"
        for start, end, txt, tid_, gtid in db.execute(query):
            name = (txt if txt is not None else strings.get(tid_, "")) or ""
            name = name.split(",", 1)[0].strip()
            iv = Interval(gtid, base + start, base + end, name)
            if name.startswith("piep."):
                ranges[pid_of(gtid)].append(iv)
            elif name.startswith("nccl") and names.canonical_op(name[4:]):
                nccl_ranges[pid_of(gtid)].append(iv)

    kernels: dict[int, list[tuple]] = defaultdict(list)  # NCCL's: collective calls
    work: dict[int, list[tuple]] = defaultdict(list)  # every kernel: the kernel table
    devices: dict[int, int] = {}
    if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
        cols = tables["CUPTI_ACTIVITY_KIND_KERNEL"]
        name_col = next((c for c in ("shortName", "demangledName", "mangledName")
                         if c in cols), None)
        if name_col is None:
            raise NsysExportError(f"{path}: CUPTI_ACTIVITY_KIND_KERNEL has no name column")
        device = "deviceId" if "deviceId" in cols else "0"
        demangled = "demangledName" if "demangledName" in cols else name_col
        for start, end, corr, gpid, dev, short, full in db.execute(
                f"SELECT start, end, correlationId, globalPid, {device}, {name_col}, "
                f"{demangled} FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY start"):
            kname = strings.get(short, str(short))
            pid = pid_of(gpid)
            work[pid].append((base + start, base + end, corr, strings.get(full, kname)))
            devices[pid] = min(devices.get(pid, dev), dev)
            op = names.nccl_kernel(kname)
            if op is not None:
                kernels[pid].append((base + start, base + end, corr, op,
                                     strings.get(full, kname)))

    launches: dict[tuple[int, int], tuple[int, int]] = {}
    wanted = {(pid, k[2]) for pid, ks in work.items() for k in ks}
    if wanted and "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
        for start, gtid, corr in db.execute(
                "SELECT start, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
            if (pid_of(gtid), corr) in wanted:
                launches[(pid_of(gtid), corr)] = (gtid, base + start)

    # The ranks are the processes with detail-mode ranges or collectives; an export with
    # neither (one process profiled without detail mode) has its kernels' processes.
    pids = sorted(set(ranges) | set(kernels) or set(work),
                  key=lambda p: (devices.get(p, 1 << 30), p))
    if not pids:
        return []
    if ranks is None:
        if rank is not None and len(pids) > 1:
            raise NsysExportError(f"{path}: {len(pids)} processes: pass ranks={{pid: rank}}")
        ranks = {pid: (rank if rank is not None else i) for i, pid in enumerate(pids)}
    world = world_size or max(len(pids), max(ranks.values(), default=0) + 1)
    traces = []
    for pid in pids:
        if pid not in ranks:
            continue
        r = ranks[pid]
        trace = RankTrace(rank=r, world_size=world, source=path, format="nsys", clock=clock,
                          host=host, pid=pid, gpu=bool(kernels.get(pid)),
                          clock_offset_ns=int(offsets.get(r, 0)))
        calls = []
        for start, end, corr, op, full in kernels.get(pid, ()):
            thread, anchor = launches.get((pid, corr), (None, None))
            calls.append(Call(op=op, arrival_ns=start, completion_ns=end, thread=thread,
                              anchor_ns=anchor, dtype=names.kernel_dtype(full) or "",
                              source=full))
        # NCCL's own range around the launch names the op of SendRecv and Generic kernels.
        own = nccl_ranges.get(pid, [])
        for call, idx in zip(calls, innermost(own, [(c.thread, c.anchor_ns) for c in calls])):
            if idx is not None and call.op in ("nccl", "send_recv"):
                call.op = names.canonical_op(own[idx].name[4:]) or call.op
        placed = []
        for start, end, corr, full in work.get(pid, ()):
            thread, anchor = launches.get((pid, corr), (None, None))
            placed.append(Work(full, "gpu", start, end, thread, anchor))
        traces.append(assemble(trace, ranges.get(pid, []), calls, group_names=group_names,
                               default_group=default_group, work=placed))
    return sorted(traces, key=lambda t: t.rank)
