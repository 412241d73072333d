"""`python -m vllm_piep.spans show PATH [--step N]`: a per-module and per-collective table of
the span files of one vLLM instance (PATH: a directory or any of its files), with the
synchronization wait and the transfer of every collective summed; `tree PATH`: the model tree
the files name. A missing, empty or malformed span file prints one line naming it and the line
at fault, and exits 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vllm_piep.cli_errors import HelpFormatter, OneLineParser, UsageError, run_cli
from vllm_piep.spans.reader import SpanFileError, SpanSet, read_span_header, span_files
from vllm_piep.spans.treemap import (
    collective_nodes,
    coverage,
    forward_steps,
    header_shape,
    merged_tree,
    node_work,
)

PROG = "python -m vllm_piep.spans"


def _paths(target: Path, instance: str | None) -> list[Path]:
    if target.is_dir():
        paths = span_files(target, instance)
        instances = {read_span_header(p).instance for p in paths}
        if len(instances) > 1:
            raise SpanFileError(f"{target} holds span files of several vLLM instances "
                                f"({', '.join(sorted(instances))}); pick one with --instance")
        return paths
    if not target.exists():
        raise SpanFileError(f"{target}: no such file or directory")
    mine = read_span_header(target).instance
    siblings = [p for p in span_files(target.parent) if read_span_header(p).instance == mine]
    return siblings or [target]


def _us(ns: float) -> str:
    return f"{ns / 1e3:,.1f}"


def _work_per_node(spans: SpanSet, steps: pd.DataFrame, mods: pd.DataFrame
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """FLOPs and bytes per rank of each module node over the chosen steps (empty when the files
    carry no model shape or tree)."""
    shape = header_shape(spans)
    if shape is None or spans.files[0].header.tree is None:
        return {}, {}
    tree = merged_tree(spans)
    flops: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    for step, row in steps.drop_duplicates("step").set_index("step").iterrows():
        for node, work in node_work(tree, shape, row, mods[mods["step"] == step]).items():
            flops[node] = flops.get(node, 0.0) + work.flops
            nbytes[node] = nbytes.get(node, 0.0) + work.bytes
    return flops, nbytes


def show(spans: SpanSet, step: int | None, console: Console) -> None:
    steps = forward_steps(spans)
    if not steps:
        console.print("no step with scheduled tokens in these files")
        return
    chosen = steps if step is None else [step]
    if step is not None and step not in steps:
        raise SpanFileError(f"step {step} has no forward pass here; steps with one: "
                            f"{steps[0]}..{steps[-1]} ({len(steps)} steps)")
    header = spans.files[0].header
    what = f"step {step}" if step is not None else f"{len(chosen)} steps (sums)"
    console.print(f"[bold]{escape(header.model)}[/] {header.architecture}  tp={header.tp_size} "
                  f"pp={header.pp_size} dp={header.dp_size}  ranks={len(spans.files)}  "
                  f"mode={header.mode}  {what}")
    st = spans.steps[spans.steps["step"].isin(chosen)]
    step_table = Table("rank", "steps", "prefill tok", "decode tok", "step µs", title="steps")
    for rank, frame in st.groupby("rank"):
        step_table.add_row(str(rank), str(len(frame)), str(int(frame["prefill_tokens"].sum())),
                           str(int(frame["decode_tokens"].sum())),
                           _us((frame["end_ns"] - frame["start_ns"]).sum()))
    console.print(step_table)

    mods = spans.modules[spans.modules["step"].isin(chosen)].copy()
    if not mods.empty:
        mods["dur"] = mods["end_ns"] - mods["start_ns"]
        flops, nbytes = _work_per_node(spans, st, mods)
        columns = ["node", "type", "layer", "ranks", "spans", "µs (mean over ranks)"]
        if flops:
            columns += ["MFLOP/rank", "GFLOP/s", "GB/s"]
        table = Table(*columns, title="modules")
        order = {node: i for i, node in enumerate(dict.fromkeys(
            mods.sort_values("start_ns")["node"]))}
        for node, frame in sorted(mods.groupby("node"), key=lambda kv: order[kv[0]]):
            seconds = frame.groupby("rank")["dur"].sum().mean()
            layer = frame["layer"].iloc[0]
            row = [escape(node), frame["type"].iloc[0], "" if pd.isna(layer) else str(int(layer)),
                   str(frame["rank"].nunique()), str(len(frame)), _us(seconds)]
            if flops:
                row += [f"{flops[node] / 1e6:,.3f}", f"{flops[node] / seconds:,.2f}",
                        f"{nbytes[node] / seconds:,.2f}"]
            table.add_row(*row)
        console.print(table)

    coll = spans.collectives[spans.collectives["step"].isin(chosen)].copy()
    if not coll.empty:
        try:
            coll["tree_node"] = collective_nodes(merged_tree(spans), coll).fillna("?")
        except ValueError:
            coll["tree_node"] = coll["node"].fillna("")
        table = Table("node", "op", "group", "calls", "bytes/call", "wait µs", "transfer µs",
                      title="collectives (summed over ranks)")
        for (node, op, group), frame in coll.groupby(["tree_node", "op", "group"], sort=False):
            table.add_row(escape(str(node)), op, group, str(len(frame)),
                          f"{frame['bytes'].mean():,.0f}", _us(frame["wait_ns"].sum()),
                          _us(frame["transfer_ns"].sum()))
        console.print(table)
        console.print(f"total wait {_us(coll['wait_ns'].sum())} µs, total transfer "
                      f"{_us(coll['transfer_ns'].sum())} µs, calls {len(coll)}")
        if (~coll["causal"] & ~coll["op"].isin(["send", "recv"])).any():
            console.print("[yellow]some collectives complete before their last arrival: the "
                          "ranks' clocks disagree (see clock_offset_ns in the headers)[/]")
    if header.mode == "detail" and step is not None:
        cov = coverage(spans, step)
        verdict = "total" if cov.total else (f"left over {cov.leftover}, missing "
                                             f"{cov.missing}, repeated {cov.repeated}")
        console.print(f"spans onto tree nodes: {verdict}", markup=False)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    p_show = sub.add_parser("show", help="per-module and per-collective tables",
                            description="Per-module and per-collective tables of span files.",
                            formatter_class=HelpFormatter)
    p_show.add_argument("path", type=Path, help="a span file or a directory of them")
    p_show.add_argument("--step", type=int, default=None, help="one step (default: all)")
    p_show.add_argument("--instance", default=None,
                        help="the vLLM instance, when a directory holds several (default: the "
                             "only one)")
    p_tree = sub.add_parser("tree", help="the model tree of the files",
                            description="The model tree the span files name.",
                            formatter_class=HelpFormatter)
    p_tree.add_argument("path", type=Path, help="a span file or a directory of them")
    p_tree.add_argument("--instance", default=None,
                        help="the vLLM instance, when a directory holds several (default: the "
                             "only one)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.path.is_dir() and not span_files(args.path, args.instance):
        which = f" of instance {args.instance!r}" if args.instance else ""
        raise UsageError(f"{args.path}: no span files{which} (*.spans.jsonl) in this directory")
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        spans = SpanSet.read(_paths(args.path, args.instance))
        if args.command == "tree":
            console.print(merged_tree(spans).render(), highlight=False, markup=False)
        else:
            show(spans, args.step, console)
    except SpanFileError as exc:
        raise UsageError(str(exc)) from exc
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
