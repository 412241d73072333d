"""Offline kernel-level traces turned into the plugin's span records (`piep.spans/1`).

Reads torch.profiler (Kineto) Chrome traces and Nsight Systems SQLite exports, finds the
ranges detail mode opens (`vllm_piep.spans.records.step_range_name`, `module_range_name`) and the
collectives (NCCL kernels, gloo works and the `c10d::` ops that posted them, vLLM's CPU
shared-memory ops), and emits per rank the same step, module and collective records the
plugin writes; `merge` puts the ranks on one clock and splits every collective into wait and
transfer with `vllm_piep.spans.reader.collective_timing`.

    traces = [read_kineto(p) for p in ("rank0.json", "rank1.json")]
    spans = merge(traces)              # a vllm_piep.spans.reader.SpanSet
    spans.collectives[["rank", "op", "seq", "wait_ns", "transfer_ns"]]

    python -m kernels_trace rank0.json rank1.json --json merged.json

Modules: `names` (what trace names mean), `kineto` and `nsys` (the readers), `records` (from
ranges and calls to span records), `merge` (one clock, span files, clock bounds).
"""

from pathlib import Path

from kernels_trace.kineto import KinetoTraceError, read_kineto
from kernels_trace.merge import MergeError, clock_bounds, merge, write_span_files
from kernels_trace.nsys import NsysExportError, read_nsys
from kernels_trace.records import Call, GroupInfo, Interval, RankTrace

__all__ = [
    "Call", "GroupInfo", "Interval", "KinetoTraceError", "MergeError", "NsysExportError",
    "RankTrace", "clock_bounds", "merge", "read", "read_kineto", "read_nsys",
    "write_span_files",
]

NSYS_SUFFIXES = (".sqlite", ".db", ".sqlite3")


def read(path, **kwargs) -> list[RankTrace]:
    """The ranks in one trace file: a Nsight Systems export by its suffix (`.sqlite`, `.db`),
    else a Kineto Chrome trace (one rank). Keyword arguments go to the reader."""
    if Path(path).suffix in NSYS_SUFFIXES:
        return read_nsys(path, **kwargs)
    return [read_kineto(path, **kwargs)]
