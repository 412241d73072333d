"""`python -m kernels_trace TRACE... --json OUT`: merge per-rank traces into one table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kernels_trace import NSYS_SUFFIXES, clock_bounds, merge, read, write_span_files


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep:
            raise SystemExit(f"--{what} wants KEY=VALUE, got {value!r}")
        out[key] = val
    return out


def _records(frame) -> list[dict]:
    return json.loads(frame.to_json(orient="records"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels_trace", description=__doc__)
    parser.add_argument("traces", nargs="+", type=Path,
                        help="Kineto Chrome traces (.json, .json.gz; one per rank) or Nsight "
                             f"Systems SQLite exports ({', '.join(NSYS_SUFFIXES)})")
    parser.add_argument("--json", type=Path, required=True, help="merged table to write")
    parser.add_argument("--offset", action="append", default=[], metavar="RANK=NS",
                        help="a rank's clock minus the reference rank's (multi-host)")
    parser.add_argument("--group-name", action="append", default=[], metavar="PG=LABEL",
                        help="rename a process group (by its name or description)")
    parser.add_argument("--default-group", help="group of calls the trace does not place")
    parser.add_argument("--spans-dir", type=Path, help="also write piep.spans/1 files here")
    args = parser.parse_args(argv)

    offsets = {int(k): int(v) for k, v in _pairs(args.offset, "offset").items()}
    options = {"group_names": _pairs(args.group_name, "group-name")}
    if args.default_group:
        options["default_group"] = args.default_group
    traces = [t for path in args.traces for t in read(path, **options)]
    spans = merge(traces, offsets)
    out = {
        "schema": "piep.spans/1",
        "sources": [str(t.source) for t in traces],
        "clock": sorted({t.clock for t in traces}),
        "clock_offsets_ns": {str(t.rank): t.clock_offset_ns for t in traces},
        "steps": _records(spans.steps),
        "modules": _records(spans.modules),
        "collectives": _records(spans.collectives),
        "clock_bounds": _records(clock_bounds(spans.collectives)),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    if args.spans_dir:
        write_span_files(traces, args.spans_dir)
    print(f"{len(traces)} ranks: {len(out['steps'])} steps, {len(out['modules'])} modules, "
          f"{len(out['collectives'])} collectives -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
