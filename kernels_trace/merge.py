"""Per-rank traces onto one clock: merged tables, span files, and what collectives say about
the clocks.

On one host the traces share a clock (Kineto: CLOCK_REALTIME; see `kernels_trace.kineto`), so
the offsets are 0. Across hosts, pass each rank's offset (its clock minus the reference rank's,
as `vllm_piep.spans.records.estimate_clock_offset` measures it) or take the midpoint of
`clock_bounds`, which the collectives themselves impose.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from kernels_trace.records import RankTrace
from vllm_piep.spans.reader import SpanSet
from vllm_piep.spans.records import P2P_OPS, header_json


class MergeError(ValueError):
    pass


def _with_offsets(traces: Sequence[RankTrace],
                  clock_offsets_ns: Mapping[int, int] | None) -> list[RankTrace]:
    if not traces:
        raise MergeError("no traces given")
    ranks = [t.rank for t in traces]
    if len(set(ranks)) != len(ranks):
        raise MergeError(f"several traces of one rank: ranks {sorted(ranks)}")
    for trace in traces:
        if clock_offsets_ns and trace.rank in clock_offsets_ns:
            trace.clock_offset_ns = int(clock_offsets_ns[trace.rank])
    return sorted(traces, key=lambda t: t.rank)


def merge(traces: Sequence[RankTrace], clock_offsets_ns: Mapping[int, int] | None = None,
          instance: str = "kernels_trace") -> SpanSet:
    """All ranks' spans as one `SpanSet`: tables with a `rank` column, timestamps moved onto the
    reference clock (each rank's offset subtracted), and the collectives split into wait and
    transfer by `vllm_piep.spans.reader.collective_timing` (`last_arrival_ns`, `participants`,
    `wait_ns`, `transfer_ns`, `causal`). `clock_offsets_ns` ({rank: ns}) overrides the offsets
    the traces were read with."""
    ordered = _with_offsets(traces, clock_offsets_ns)
    return SpanSet.from_files([t.span_file(instance) for t in ordered])


def write_span_files(traces: Sequence[RankTrace], directory: str | Path,
                     instance: str = "kernels_trace",
                     clock_offsets_ns: Mapping[int, int] | None = None) -> list[Path]:
    """Writes one `piep.spans/1` file per rank (`{instance}-rank{r}.spans.jsonl`), readable
    with `vllm_piep.spans.reader.SpanSet.read` like the plugin's own."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for trace in _with_offsets(traces, clock_offsets_ns):
        path = directory / f"{instance}-rank{trace.rank}.spans.jsonl"
        lines = [header_json(trace.header(instance))]
        lines += [json.dumps(r, separators=(",", ":")) for r in trace.records()]
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths


def clock_bounds(collectives: pd.DataFrame, reference: int | None = None) -> pd.DataFrame:
    """What the collectives allow each rank's clock offset to be, relative to `reference`
    (default: the lowest rank), on the table's current clock: a collective completes on no
    rank before it arrived on every rank, so for ranks r and q in one call
    `arrival_r - completion_q <= offset_r - offset_q <= completion_r - arrival_q`. Returns
    one row per rank: `rank`, `lo_ns`, `hi_ns`, `calls` (shared calls used). With correct
    offsets, 0 lies in every [lo, hi]; on one host that checks the clock, across hosts the
    midpoint estimates the remaining offset. Send/recv and posting-only calls are left out
    (a buffered send may complete before its receiver arrives)."""
    rows = collectives[~collectives["op"].isin(P2P_OPS) & ~collectives["is_async"]]
    if rows.empty:
        return pd.DataFrame(columns=["rank", "lo_ns", "hi_ns", "calls"])
    reference = int(rows["rank"].min()) if reference is None else reference
    ref = rows[rows["rank"] == reference][["group", "seq", "arrival_ns", "completion_ns"]]
    joined = rows.merge(ref, on=["group", "seq"], suffixes=("", "_ref"))
    joined["lo"] = joined["arrival_ns"] - joined["completion_ns_ref"]
    joined["hi"] = joined["completion_ns"] - joined["arrival_ns_ref"]
    mine = joined["rank"] == reference
    joined.loc[mine, ["lo", "hi"]] = 0
    out = joined.groupby("rank").agg(lo_ns=("lo", "max"), hi_ns=("hi", "min"),
                                     calls=("lo", "size")).reset_index()
    return out.astype({"rank": "int64", "lo_ns": "int64", "hi_ns": "int64", "calls": "int64"})
