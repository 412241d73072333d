"""`python -m kernels_trace TRACE... [--json OUT]`: merge per-rank traces into one table.

    python -m kernels_trace rank0.json.gz rank1.json.gz --json merged.json
    python -m kernels_trace forward.json.gz --rank 0      # print the summary, write nothing

One trace per rank (torch.profiler's Kineto JSON, which names its rank in `distributedInfo`
when torch.distributed runs), or a Nsight Systems SQLite export holding several processes.
A single-process trace has no rank: give it with `--rank 0`. Besides the span records, the
JSON holds `kernels` (kernel count and time per rank, step, module node and kernel name) and
`kernel_coverage` (per rank, the share of kernel time inside a module of the model tree, and
the kernels outside every module, by name). Without `--json` it prints the same summary
(ranks, steps, modules, collectives, kernels, and each rank's kernel time in the model tree)
and writes nothing. `--json`'s directory must exist; `--spans-dir` is created.

Bad input (a missing, empty or unreadable trace, a malformed KEY=VALUE) prints one line naming
it and exits 2; exit 1 is a bug.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from kernels_trace import NSYS_SUFFIXES, clock_bounds, merge, read, write_span_files
from kernels_trace.kernels import by_node, coverage
from kernels_trace.kineto import KinetoTraceError
from kernels_trace.merge import MergeError
from kernels_trace.nsys import NsysExportError
from vllm_piep.cli_errors import (
    HelpFormatter,
    OneLineParser,
    UsageError,
    existing_file,
    output_file,
    run_cli,
)

PROG = "python -m kernels_trace"


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key or not val:
            raise UsageError(f"--{what} {value!r}: expected KEY=VALUE")
        out[key] = val
    return out


def _offsets(values: list[str]) -> dict[int, int]:
    out = {}
    for key, val in _pairs(values, "offset").items():
        try:
            rank, ns = int(key), int(val)
        except ValueError:
            raise UsageError(f"--offset {key}={val}: expected RANK=NS, two integers") from None
        if rank < 0:
            raise UsageError(f"--offset {key}={val}: a rank is 0 or more")
        out[rank] = ns
    return out


def _rank(text: str) -> int:
    try:
        rank = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if rank < 0:
        raise argparse.ArgumentTypeError(f"{rank}: a rank is 0 or more")
    return rank


def _records(frame: Any) -> list[dict[str, Any]]:
    return json.loads(frame.to_json(orient="records"))


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("traces", nargs="+", type=Path,
                   help="Kineto Chrome traces (.json, .json.gz; one per rank) or Nsight "
                        f"Systems SQLite exports ({', '.join(NSYS_SUFFIXES)})")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="write the merged table to this file, in an existing directory "
                        "(default: print the summary only)")
    p.add_argument("--rank", type=_rank, default=None,
                   help="the rank of a single-process trace, which names none (one trace "
                        "only; default: the trace's distributedInfo.rank)")
    p.add_argument("--offset", action="append", default=[], metavar="RANK=NS",
                   help="a rank's clock minus the reference rank's (multi-host); repeatable")
    p.add_argument("--group-name", action="append", default=[], metavar="PG=LABEL",
                   help="rename a process group (by its name or description); repeatable")
    p.add_argument("--default-group", default=None,
                   help="group of calls the trace does not place (default: the reader's, "
                        "'nccl' for Nsight exports)")
    p.add_argument("--spans-dir", type=Path, default=None,
                   help="also write piep.spans/1 files here (default: none)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.rank is not None and len(args.traces) != 1:
        raise UsageError(f"--rank {args.rank}: names the rank of one trace, got "
                         f"{len(args.traces)} traces")
    offsets = _offsets(args.offset)
    options: dict[str, Any] = {"group_names": _pairs(args.group_name, "group-name")}
    if args.default_group:
        options["default_group"] = args.default_group
    if args.rank is not None:
        options["rank"] = args.rank
    if args.json is not None:
        output_file(args.json, "--json")
    for path in args.traces:
        existing_file(path, "trace")
    try:
        traces = [t for path in args.traces for t in read(path, **options)]
        spans = merge(traces, offsets)
        kernels = pd.concat([t.kernels for t in traces], ignore_index=True)
    except (KinetoTraceError, NsysExportError, MergeError) as exc:
        raise UsageError(str(exc)) from exc
    out = {
        "schema": "piep.spans/1",
        "sources": [str(t.source) for t in traces],
        "clock": sorted({t.clock for t in traces}),
        "clock_offsets_ns": {str(t.rank): t.clock_offset_ns for t in traces},
        "steps": _records(spans.steps),
        "modules": _records(spans.modules),
        "collectives": _records(spans.collectives),
        "clock_bounds": _records(clock_bounds(spans.collectives)),
        "kernels": _records(by_node(kernels)),
        "kernel_coverage": coverage(kernels),
    }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    if args.spans_dir:
        write_span_files(traces, args.spans_dir)
    print(f"{len(traces)} ranks: {len(out['steps'])} steps, {len(out['modules'])} modules, "
          f"{len(out['collectives'])} collectives, {len(kernels)} kernels"
          + ("" if args.json is None else f" -> {args.json}"))
    for rank, part in out["kernel_coverage"].items():
        print(f"rank {rank}: {part['share_in_modules']:.1%} of {part['total_ns'] / 1e6:.3f} ms "
              f"of {'/'.join(part['device'])} kernel time in a module of the model tree")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
