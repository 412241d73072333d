"""Spans onto the model tree: which node each span measures, whether a step's spans cover the
tree one to one, and the FLOPs and bytes behind each node's span. No vLLM imports."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from vllm_piep.model.flops import (
    ModelShape,
    ModuleWork,
    StepTotals,
    add_work,
    module_work_of_totals,
    moe_part_work,
)
from vllm_piep.model.tree import ModelTree
from vllm_piep.spans.reader import SpanSet


def merged_tree(spans: SpanSet) -> ModelTree:
    trees = [ModelTree.from_dict(f.header.tree) for f in spans.files if f.header.tree]
    if not trees:
        raise ValueError("these span files hold no model tree (they were written in serve "
                         "mode, which records step spans only)")
    return ModelTree.merge(trees)


def owners(spans: SpanSet) -> dict[str, set[int]]:
    """The ranks that run each node (the ranks whose own tree holds it)."""
    out: dict[str, set[int]] = {}
    for f in spans.files:
        if f.header.tree:
            for node in ModelTree.from_dict(f.header.tree):
                out.setdefault(node.id, set()).add(f.header.rank)
    return out


def collective_nodes(tree: ModelTree, collectives: pd.DataFrame) -> pd.Series:
    """The communication node of each collective span (None where the tree has none)."""
    if collectives.empty:
        return pd.Series([], dtype=object)
    peers = collectives["peer"].astype(object).where(collectives["peer"].notna(), None)
    nodes = [tree.comm_node_for(op, group, enclosing, int(rank), None if peer is None
                                else int(peer))
             for op, group, enclosing, rank, peer in zip(
                 collectives["op"], collectives["group"],
                 collectives["node"].astype(object).where(collectives["node"].notna(), None),
                 collectives["rank_in_group"], peers)]
    return pd.Series(nodes, index=collectives.index, dtype=object)


@dataclass
class Coverage:
    """How one step's spans meet the tree: each (node, rank) that runs it should have exactly
    one span; the transfer and wait children are measured by their parent's span."""

    step: int
    leftover: list[str] = field(default_factory=list)  # spans with no node
    missing: list[tuple[str, int]] = field(default_factory=list)  # (node, rank) with no span
    repeated: list[tuple[str, int, int]] = field(default_factory=list)  # (node, rank, count)

    @property
    def total(self) -> bool:
        return not (self.leftover or self.missing or self.repeated)


def coverage(spans: SpanSet, step: int, tree: ModelTree | None = None) -> Coverage:
    tree = tree or merged_tree(spans)
    runs = owners(spans)
    result = Coverage(step)
    modules = spans.modules[spans.modules["step"] == step]
    collectives = spans.collectives[spans.collectives["step"] == step]
    counts: dict[tuple[str, int], int] = {}
    for node, rank in zip(modules["node"], modules["rank"]):
        if node not in tree.nodes:
            result.leftover.append(f"module span {node} on rank {rank}")
            continue
        counts[(node, int(rank))] = counts.get((node, int(rank)), 0) + 1
    comm = collective_nodes(tree, collectives)
    for (_, row), node in zip(collectives.iterrows(), comm):
        if node is None:
            result.leftover.append(f"{row['op']} in {row['group']} inside {row['node']} on "
                                   f"rank {row['rank']}")
            continue
        counts[(node, int(row["rank"]))] = counts.get((node, int(row["rank"])), 0) + 1
    for node in tree:
        if node.modules is None and node.type not in ("all_reduce", "all_gather", "gather",
                                                      "send_recv", "all_to_all"):
            continue  # model, layers, transfer/wait: measured through their children/parent
        for rank in sorted(runs.get(node.id, ())):
            count = counts.get((node.id, rank), 0)
            if count == 0:
                result.missing.append((node.id, rank))
            elif count > 1:
                result.repeated.append((node.id, rank, count))
    return result


def forward_steps(spans: SpanSet) -> list[int]:
    """Steps in which the model ran (some tokens were scheduled)."""
    steps = spans.steps
    active = steps[(steps["prefill_tokens"] + steps["decode_tokens"]) > 0]
    return sorted(int(s) for s in active["step"].unique())


def node_work(tree: ModelTree, shape: ModelShape, step: Mapping[str, Any],
              modules: pd.DataFrame | None = None, per_rank: bool = True
              ) -> dict[str, ModuleWork]:
    """FLOPs and bytes of every module node of `tree` in one step (a step span's row), from
    `flops.module_work_of_totals`: per tensor-parallel rank by default, as each rank's spans
    measure. A layer's two norms are told apart by the order they ran in (`modules`: that
    step's module spans) or else the tree's order: the first is the one before attention."""
    totals = StepTotals(tokens=float(step["prefill_tokens"] + step["decode_tokens"]),
                        attended_pairs=float(step["attended_pairs"]),
                        context_tokens=float(step["context_tokens"]),
                        sampled_rows=float(step["sampled_rows"]))
    work = module_work_of_totals(shape, totals, per_rank=per_rank)
    started: dict[str, float] = {}
    if modules is not None and not modules.empty:
        started = modules.groupby("node")["start_ns"].min().to_dict()
    parts = moe_part_work(shape, totals, per_rank=per_rank)
    out: dict[str, ModuleWork] = {}
    for node in tree:
        if node.modules is None:
            continue
        if node.type in ("router", "shared_expert"):
            out[node.id] = parts[node.type]
        elif node.type == "experts":  # its span holds the router and shared expert it calls
            out[node.id] = add_work([parts["routed"], *(parts[tree[c].type]
                                                        for c in node.children
                                                        if tree[c].type in parts)])
        elif node.type in ("attention", "mlp"):
            out[node.id] = work[f"layers.{node.layer}.{node.type}"]
        elif node.type == "norm":
            listed = [c for c in tree[f"layers.{node.layer}"].children
                      if tree[c].type == "norm"]
            ran = sorted(listed, key=lambda c: started.get(c, float(listed.index(c))))
            role = "attention_norm" if ran.index(node.id) == 0 else "mlp_norm"
            out[node.id] = work[f"layers.{node.layer}.{role}"]
        else:  # embedding, final_norm, logits
            out[node.id] = work[node.type]
    return out


def header_shape(spans: SpanSet) -> ModelShape | None:
    raw = spans.files[0].header.shape
    return ModelShape(**raw) if raw else None
