"""Detail-mode span files (`*.spans.jsonl`, schema `piep.spans/1`) plus the campaign's meter log
(`meter.jsonl`, `meters.log`) as a `TreeDataset`: the training data of the calibrate path.

One tree per forward step of each data-parallel instance. The root is the step (level model,
node `model`, type `step`); below it the merged `ModelTree` of the instance's ranks, with its
parent links: decoder layers (level module, type `layer`), module nodes (type = module kind:
`embedding`, `attention_norm`, `attention`, `mlp_norm`, `mlp`, `final_norm`, `logits`),
communication nodes (type = op: `all_reduce`, `send_recv`, `all_gather`, `gather`) each with its
`/transfer` and `/wait` children (type `transfer`, `wait`).

Choices, so that what a number means is written down:
- A node's window is the hull of its spans over the ranks that ran it (earliest start, latest
  end), on rank 0's clock; `time_s` is the mean over those ranks of the node's own duration.
  Wait is arrival to the last participant's arrival, transfer from there to completion
  (`spans.collective_timing`). A layer spans its first child's start to its last child's end.
- `energy_j` is the meter's energy over the node's window, summed over all the meter's devices,
  from its cumulative readings interpolated linearly (`windows.span_energy`). It is NaN where the
  readings do not cover the window or the window is shorter than the meter's resolution (e.g. a
  20 µs module under a 50 ms meter: unmeasured, not a bad row), and where it is not positive (a
  zero-length wait). The meter measures everything it sees: with several instances on one
  metered host, a window's energy includes theirs. Meter timestamps are taken to be on rank 0's
  CLOCK_MONOTONIC (the meter runs on rank 0's host).
- `device_energy_j` is the same window's energy from the meter's `gpu` devices only (their own
  counters, as NVML's; IrEne's `gpu_energy_mean`), NaN when the meter has no gpu device.
- `gflop`, `mem_mib` are per tensor-parallel rank (`spans.treemap.node_work`); `comm_mib` is the
  collective payload per rank (mean over ranks). Leaves carry their own; every inner node the
  sum over its children, so that each feature is present on every row (wait nodes: zeros).
- Resource features are the rank's samples over the node's window (`resources.window_features`'
  rule) aggregated across ranks: the plain name is the mean, `_std`, `_min`, `_max` the spread.
- `n_devices` = tp x pp: the devices that run one tree (one data-parallel instance).

Bad rows (never dropped silently): a malformed span line (file:line, the rest of the file is
used), a span that maps onto no tree node or repeats one (file:line), a node with no span on a
rank that runs it or a rank without the step record (file:0, the step in the reason). A step
with any of these is left out whole: its tree would be wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vllm_piep.datasets.features import RANK_STATS
from vllm_piep.datasets.model import BadRows, DatasetError, IssueLog, Level, TreeDataset
from vllm_piep.meters.common import MeterError
from vllm_piep.meters.log import LoggedMeter, read_meter_log
from vllm_piep.meters.resources import across_ranks
from vllm_piep.meters.windows import span_energy
from vllm_piep.model.flops import MODULE_COMPONENT, ModelShape
from vllm_piep.model.tree import COMM_TYPES, TreeNode
from vllm_piep.spans.reader import SpanFile, SpanFileError, SpanSet, read_span_file, span_files
from vllm_piep.spans.treemap import (
    collective_nodes,
    coverage,
    forward_steps,
    header_shape,
    merged_tree,
    node_work,
)

METER_LOG = "meter.jsonl"
MIB = float(2**20)
# resources.py sample name -> canonical feature (vllm_piep.datasets.features).
RESOURCE_NAMES: dict[str, str] = {
    "cpu_util": "cpu_util_pct", "cpu_mem_util": "mem_util_pct", "gpu_util": "gpu_util_pct",
    "gpu_mem_util": "gpu_mem_util_pct", "gpu_clock_mhz": "gpu_clock_mhz",
    "gpu_mem_clock_mhz": "gpu_mem_clock_mhz",
}
COMM_COMPONENT: dict[str, str] = {"all_reduce": "allreduce", "send_recv": "p2p",
                                  "all_gather": "allgather", "gather": "allgather",
                                  "all_to_all": "alltoall"}
WORK = ("gflop", "mem_mib", "comm_mib")
FEATURES: tuple[str, ...] = (
    "time_s", *WORK, "device_energy_j", "batch_size", "prefill_tokens", "decode_tokens",
    "context_tokens", "n_devices", "tp", "pp", "dp", "layers", "hidden_size", "ffn_size",
    "heads", "kv_heads", "head_dim", "vocab_size",
)


def load_span_dataset(directory: str | Path, policy: BadRows = BadRows.SKIP,
                      meter_log: str | Path | None = None) -> TreeDataset:
    """The trees of every forward step recorded in `directory` (all instances in it), with
    energies from `meter_log` (default: `directory/meter.jsonl` if there is one, else all
    energies NaN; a `meter_log` given but missing is an error)."""
    root = Path(directory)
    if meter_log is not None and not Path(meter_log).is_file():
        raise DatasetError(f"{meter_log}: no such meter log")
    paths = span_files(root)
    if not paths:
        raise DatasetError(f"{root}: no span files (*.spans.jsonl)")
    log = IssueLog(policy)
    files = [f for f in (_read_tolerant(p, log) for p in paths) if f is not None]
    rows: list[dict[str, Any]] = []
    trees: list[dict[str, Any]] = []
    for instance in sorted({f.header.instance for f in files}):
        mine = [f for f in files if f.header.instance == instance]
        if not any(f.header.tree for f in mine):
            log.report(mine[0].path, 1, f"instance {instance!r}: no model tree in the headers "
                       "(serve mode records step spans only; record with --piep-mode detail)")
            continue
        spans = SpanSet.from_files(mine)
        for dp_rank in sorted({f.header.dp_rank for f in mine}):
            group = _dp_group(spans, dp_rank, log)
            if group is not None:
                _Instance(group, log).build(rows, trees)
    nodes = pd.DataFrame(rows)
    resource_cols = [c for c in nodes.columns if c in _resource_features()]
    if rows:
        _add_energy(nodes, meter_log if meter_log is not None else root / METER_LOG)
    else:
        nodes = pd.DataFrame({c: [] for c in ("tree_id", "node_id", "parent_id", "level",
                                              *FEATURES)})
    issues = log.close()
    tree_frame = pd.DataFrame(trees, columns=["tree_id", "dataset", "model", "group", "hardware",
                                              "batch_size", "seq_len", "tp", "pp", "dp"])
    nodes = nodes.drop(columns=["_start", "_end"], errors="ignore")
    return TreeDataset.from_frames("spans", nodes, tree_frame, (*FEATURES, *resource_cols),
                                   issues)


def _resource_features() -> list[str]:
    return [f"{n}{s}" for n in RESOURCE_NAMES.values() for s in ("", *(f"_{a}" for a in
                                                                       RANK_STATS))]


# --------------------------------------------------------------------------- reading files
def _read_tolerant(path: Path, log: IssueLog) -> SpanFile | None:
    """`spans.read_span_file`, except that a malformed record is reported (file:line) and
    skipped instead of refusing the file, and each record keeps its line number (`line`)."""
    try:
        return read_span_file(path, on_bad_line=lambda line, reason: log.report(
            path, line, f"malformed span record: {reason}"), line_numbers=True)
    except SpanFileError as exc:
        log.report(path, 1, f"unreadable header, file skipped: {exc}")
        return None


def _dp_group(spans: SpanSet, dp_rank: int, log: IssueLog) -> SpanSet | None:
    """The ranks of one data-parallel instance, with collective timing taken over all ranks
    (the data-parallel all-gather spans instances). None, reported, when a rank's file is
    missing: its spans would be silently absent from every node's mean."""
    files = [f for f in spans.files if f.header.dp_rank == dp_rank]
    h = files[0].header
    if len(files) != h.tp_size * h.pp_size:
        log.report(files[0].path, 0, f"data-parallel rank {dp_rank} of instance {h.instance!r}: "
                   f"{len(files)} usable span files, tp x pp = {h.tp_size * h.pp_size}; all "
                   "its steps left out")
        return None
    ranks = {f.header.rank for f in files}

    def of(frame: pd.DataFrame) -> pd.DataFrame:
        return frame[frame["rank"].isin(ranks)] if "rank" in frame else frame

    return SpanSet(files, of(spans.steps), of(spans.modules), of(spans.collectives),
                   of(spans.resources))


# --------------------------------------------------------------------------- one instance
@dataclass
class _Window:
    """A node's spans in one step: per rank (start, end) on rank 0's clock, the file line."""

    per_rank: dict[int, tuple[int, int]] = field(default_factory=dict)
    line: dict[int, int] = field(default_factory=dict)
    payload: dict[int, float] = field(default_factory=dict)  # collective bytes per rank

    def add(self, rank: int, start: int, end: int, line: int = 0) -> None:
        self.per_rank[rank] = (start, end)
        self.line[rank] = line


class _Instance:
    """Builds the trees of one data-parallel instance's forward steps."""

    def __init__(self, spans: SpanSet, log: IssueLog):
        self.spans = spans
        self.log = log
        self.tree = merged_tree(spans)
        self.shape: ModelShape | None = header_shape(spans)
        self.header = min((f.header for f in spans.files), key=lambda h: h.rank)
        self.paths = {f.header.rank: f.path for f in spans.files}
        self.samples = _samples_by_rank(spans.resources)

    def build(self, rows: list[dict[str, Any]], trees: list[dict[str, Any]]) -> None:
        # Split by step once: filtering the whole run for each step is quadratic in its length.
        colls = self.spans.collectives
        colls = colls.assign(tree_node=collective_nodes(self.tree, colls).astype(object))
        frames = (self.spans.steps, self.spans.modules, colls)
        parts = [_by_step(f) for f in frames]
        empty = [f.iloc[0:0] for f in frames]
        for step in forward_steps(self.spans):
            view = SpanSet(self.spans.files, *(p.get(step, e) for p, e in zip(parts, empty)))
            if self._complete(step, view):
                tree_id = (f"spans/{self.header.instance}/dp{self.header.dp_rank}/"
                           f"step{step}")
                rows.extend(self._nodes(view, tree_id))
                trees.append(self._tree_row(view, tree_id))

    # -- checks ---------------------------------------------------------------------------
    def _complete(self, step: int, view: SpanSet) -> bool:
        """Whether the step's spans (`view`) cover the tree one to one (`spans.treemap.coverage`);
        each reason otherwise goes to the log, with the record's line where there is one."""
        mods, colls = view.modules, view.collectives
        before = len(self.log.issues)
        for rank in sorted(set(self.paths) - set(view.steps["rank"])):
            self.log.report(self.paths[rank], 0, f"step {step}: no step record on rank {rank}")
        unmapped = mods[~mods["node"].isin(list(self.tree.nodes))]
        for r in unmapped.itertuples():
            self.log.report(self.paths[r.rank], r.line, f"step {step}: module span {r.node!r} "
                            "is no node of the model tree")
        for r in colls[colls["tree_node"].isna()].itertuples():
            self.log.report(self.paths[r.rank], r.line, f"step {step}: {r.op} in {r.group} "
                            f"inside {r.node} maps onto no tree node")
        keyed = pd.concat([mods[["node", "rank", "line"]],
                           colls[["tree_node", "rank", "line"]].rename(
                               columns={"tree_node": "node"})])
        keyed = keyed[keyed["node"].notna()]
        for r in keyed[keyed.duplicated(["node", "rank"])].itertuples():
            self.log.report(self.paths[r.rank], r.line, f"step {step}: a second span of "
                            f"{r.node!r} on rank {r.rank}")
        result = coverage(view, step, self.tree)
        for node, rank in result.missing:
            self.log.report(self.paths[rank], 0, f"step {step}: no span of {node!r} on rank "
                            f"{rank}, which runs it")
        if not result.total and len(self.log.issues) == before:
            self.log.report(self.paths[self.header.rank], 0, f"step {step}: spans do not map "
                            f"onto the tree one to one ({result})")
        return len(self.log.issues) == before

    # -- nodes ----------------------------------------------------------------------------
    def _windows(self, view: SpanSet) -> dict[str, _Window]:
        out: dict[str, _Window] = {}
        for r in view.steps.itertuples():
            out.setdefault("model", _Window()).add(r.rank, r.start_ns, r.end_ns, r.line)
        for r in view.modules.itertuples():
            out.setdefault(r.node, _Window()).add(r.rank, r.start_ns, r.end_ns, r.line)
        for r in view.collectives.itertuples():
            node = r.tree_node
            settled = r.arrival_ns + r.wait_ns
            parts = ((node, r.arrival_ns, r.completion_ns), (f"{node}/wait", r.arrival_ns,
                     settled), (f"{node}/transfer", settled, r.completion_ns))
            for node_id, a, b in parts:
                out.setdefault(node_id, _Window()).add(r.rank, a, b, r.line)
            out[f"{node}/transfer"].payload[r.rank] = float(r.bytes)
        self._fill_inner(self.tree.root, out)
        return out

    def _fill_inner(self, node_id: str, out: dict[str, _Window]) -> None:
        """Windows of nodes without spans of their own (layers): first child's start to last
        child's end, per rank."""
        children = self.tree[node_id].children
        for child in children:
            self._fill_inner(child, out)
        if node_id in out or not children:
            return
        win = out.setdefault(node_id, _Window())
        for child in (out[c] for c in children if c in out):
            for rank, (a, b) in child.per_rank.items():
                lo, hi = win.per_rank.get(rank, (a, b))
                win.per_rank[rank] = (min(lo, a), max(hi, b))

    def _nodes(self, view: SpanSet, tree_id: str) -> list[dict[str, Any]]:
        first = view.steps.sort_values("rank").iloc[0]
        work = node_work(self.tree, self.shape, first, view.modules) if self.shape else {}
        windows = self._windows(view)
        roles = self._norm_roles(windows)
        common = {**self._step_features(first), **self._structure()}
        totals: dict[str, dict[str, float]] = {}
        self._sum_work(self.tree.root, windows, work, totals)
        rows = []
        for node in self.tree:
            win = windows[node.id]
            rank = min(win.per_rank)
            rows.append({
                "tree_id": tree_id, "node_id": node.id, "parent_id": self._parent(node.id),
                "level": _level(node), "type": _type(node, roles), "scope": node.id,
                "component": self._component(node, roles), "source": str(self.paths[rank]),
                "line": int(win.line.get(rank, 0)), **common, **totals[node.id],
                "time_s": float(np.mean([b - a for a, b in win.per_rank.values()])) / 1e9,
                **self._resources(win), "_start": min(a for a, _ in win.per_rank.values()),
                "_end": max(b for _, b in win.per_rank.values())})
        return rows

    def _parent(self, node_id: str) -> str:
        if not hasattr(self, "_parents"):
            self._parents = {c: n.id for n in self.tree for c in n.children}
        return self._parents.get(node_id, "")

    def _norm_roles(self, windows: Mapping[str, _Window]) -> dict[str, str]:
        """attention_norm / mlp_norm for each layer norm, by the order the two ran in (as
        `spans.treemap.node_work` decides it): the first is the one before attention."""
        roles: dict[str, str] = {}
        for node in self.tree:
            if node.type != "layer":
                continue
            norms = [c for c in node.children if self.tree[c].type == "norm"]
            ran = sorted(norms, key=lambda c: min(a for a, _ in windows[c].per_rank.values()))
            for i, c in enumerate(ran):
                roles[c] = "attention_norm" if i == 0 else "mlp_norm"
        return roles

    def _component(self, node: TreeNode, roles: Mapping[str, str]) -> str:
        if node.id == self.tree.root:
            return "model"
        if node.type in COMM_TYPES:
            return COMM_COMPONENT.get(node.type, "other")
        if node.type == "wait":
            return "sync_wait"
        if node.type == "transfer":
            return COMM_COMPONENT.get(self.tree[self._parent(node.id)].type, "other")
        return MODULE_COMPONENT.get(_type(node, roles), "other")

    def _sum_work(self, node_id: str, windows: Mapping[str, _Window],
                  work: Mapping[str, Any], out: dict[str, dict[str, float]]) -> None:
        """gflop, mem_mib, comm_mib of every node: module nodes their own (a module whose span
        holds its children's, as an MoE block's experts hold the router: inclusive), other
        inner nodes the sum of their children."""
        node = self.tree[node_id]
        for child in node.children:
            self._sum_work(child, windows, work, out)
        if node.children and node_id not in work:
            out[node_id] = {k: sum(out[c][k] for c in node.children) for k in WORK}
        elif node.type in ("transfer", "wait"):
            payload = windows[node_id].payload
            out[node_id] = {"gflop": 0.0, "mem_mib": 0.0,
                            "comm_mib": float(np.mean(list(payload.values()))) / MIB
                            if payload else 0.0}
        else:
            w = work.get(node_id)
            out[node_id] = {"gflop": w.flops / 1e9 if w else np.nan,
                            "mem_mib": w.bytes / MIB if w else np.nan, "comm_mib": 0.0}

    def _step_features(self, step: pd.Series) -> dict[str, float]:
        h = self.header
        return {"batch_size": float(step["num_reqs"]),
                "prefill_tokens": float(step["prefill_tokens"]),
                "decode_tokens": float(step["decode_tokens"]),
                "context_tokens": float(step["context_tokens"]),
                "n_devices": float(h.tp_size * h.pp_size), "tp": float(h.tp_size),
                "pp": float(h.pp_size), "dp": float(h.dp_size)}

    def _structure(self) -> dict[str, float]:
        sh = self.shape
        names = {"layers": "layers", "hidden_size": "hidden", "ffn_size": "intermediate",
                 "heads": "heads", "kv_heads": "kv_heads", "head_dim": "head_dim",
                 "vocab_size": "vocab"}
        return {k: float(getattr(sh, v)) if sh else np.nan for k, v in names.items()}

    def _resources(self, win: _Window) -> dict[str, float]:
        per_rank = []
        for rank, (a, b) in win.per_rank.items():
            if rank in self.samples:
                per_rank.append(_window_means(*self.samples[rank], a, b))
        if not per_rank:
            return {}
        stats = across_ranks(per_rank)
        return {(k[:-len("_mean")] if k.endswith("_mean") else k): v for k, v in stats.items()}

    def _tree_row(self, view: SpanSet, tree_id: str) -> dict[str, Any]:
        h = self.header
        return {"tree_id": tree_id, "dataset": "spans", "model": h.model, "group": h.instance,
                "hardware": h.host, "batch_size": float(view.steps["num_reqs"].max()),
                "seq_len": np.nan,
                "tp": float(h.tp_size), "pp": float(h.pp_size), "dp": float(h.dp_size)}


def _by_step(frame: pd.DataFrame) -> dict[int, pd.DataFrame]:
    return {int(k): g for k, g in frame.groupby("step", sort=False)}


def _samples_by_rank(resources: pd.DataFrame
                     ) -> dict[int, tuple[np.ndarray, np.ndarray, list[str]]]:
    """Each rank's resource samples as (sorted times, values, canonical names)."""
    names = [c for c in resources.columns if c in RESOURCE_NAMES]
    if "rank" not in resources or not names:
        return {}
    out = {}
    for rank, g in resources.groupby("rank"):
        g = g.sort_values("t_ns")
        values = g[names].to_numpy(dtype=np.float64)
        out[int(rank)] = (g["t_ns"].to_numpy(np.int64), values,
                          [RESOURCE_NAMES[n] for n in names])
    return out


def _window_means(t: np.ndarray, values: np.ndarray, names: list[str], start: int,
                  end: int) -> dict[str, float]:
    """`resources.window_features`' rule (mean of the samples inside the window, else the last
    sample before its end, else the first) on arrays: a campaign has thousands of windows per
    rank, and filtering a DataFrame for each one dominated the load time."""
    lo, hi = np.searchsorted(t, start, "left"), np.searchsorted(t, end, "right")
    rows = values[lo:hi] if hi > lo else values[max(hi - 1, 0):max(hi, 1)]
    finite = ~np.isnan(rows)
    counts = finite.sum(axis=0)
    sums = np.where(finite, rows, 0.0).sum(axis=0)
    return {n: float(s / c) for n, s, c in zip(names, sums, counts) if c > 0}


def _level(node: TreeNode) -> str:
    if node.level == "model":
        return Level.MODEL.value
    return Level.COMMUNICATION.value if node.level == "communication" else Level.MODULE.value


def _type(node: TreeNode, roles: Mapping[str, str]) -> str:
    if node.level == "model":
        return "step"
    return roles.get(node.id, node.type)


# --------------------------------------------------------------------------- energy
def _add_energy(nodes: pd.DataFrame, meter_log: str | Path) -> None:
    """`energy_j` and `device_energy_j` of each node's window (see the module docstring)."""
    nodes["energy_j"] = np.nan
    nodes["device_energy_j"] = np.nan
    path = Path(meter_log)
    if not path.is_file():
        return
    try:
        header, readings = read_meter_log(path)
    except (MeterError, OSError) as exc:  # MeterLogError names file and line
        raise DatasetError(str(exc)) from exc
    if len(readings) < 2:
        return
    meter = LoggedMeter(header, readings)
    try:
        energy = span_energy(nodes, readings, meter, start="_start", end="_end")
    except MeterError as exc:
        raise DatasetError(f"{path}: {exc}") from exc
    measured = energy["covered"].to_numpy(bool) & energy["resolved"].to_numpy(bool)
    total = energy["total"].to_numpy(float)
    nodes["energy_j"] = np.where(measured & (total > 0), total, np.nan)
    gpus = [d.name for d in header.devices if d.kind == "gpu" and d.name in energy]
    if gpus:
        device = energy[gpus].sum(axis=1, min_count=1).to_numpy(float)
        nodes["device_energy_j"] = np.where(measured & (device > 0), device, np.nan)

