"""The campaign's dataset: detail-mode spans of every done cell, with energies from the meter log.

Each attempt directory of a campaign (`campaign/`) holds one server's span files, its meter
log and an idle window. Per forward step that ran inside a done cell there is one tree
(`datasets.spans`), with one more leaf under the root, `overhead`: the step's work outside the
model's modules (input preparation, sampling, scheduling). Energies are *dynamic*: the meter's
energy minus the idle power over the same time, which the bundle adds back as static power.
Where each energy comes from (column `energy_source`):

- module and collective leaves (`replay`): repeated sampling (PIE-P Appendix L). On a sampled
  step the worker ran each module and collective `calls` times back to back in a few windows;
  a window's energy (the meter log over the hull of the window across ranks) divided by its
  calls is one sample, and the node's energy is the mean over windows (spread: `samples`).
  A replayed collective is the transfer: the ranks replay it in lockstep, with next to no wait.
- module leaves are what their replay costs minus the replay of the collective the module runs
  inside it (vLLM all-reduces inside row-parallel layers): the collective is its own leaf.
- wait leaves (`sync-sampling`, an estimate): the wait-time distribution of every configuration
  and collective, over all its unsampled steps and ranks, is kept as quantiles (`sync`); a wait
  node's energy is the distribution's mean wait times the dynamic power the configuration's
  collective replays drew (PIE-P: the wait energy from the sampled distribution, since one
  step's wait is not predictable). What a step's own waits drew at that power is kept too
  (`observed_wait_j`). The serve path, which sees no per-rank arrivals, uses the same mean.
- the root (`window`): the steps of one shape (requests, prefill or decode) in one attempt are
  repeated samples of one workload: their dynamic energy over the unsampled ones divided by
  their time is the shape's power, and each step's energy is that power times the step's own
  time (a sampled step's: the shape's median time, since replays distort its own). A shape
  whose unsampled steps last less than five meter resolutions in all takes the power of its
  kind (prefill or decode) over all batch sizes, then of all the attempt's steps; steps are
  unresolved only when even those are too short.
- overhead (`remainder`): on sampled steps, the root minus every other leaf; NaN where any is
  unknown or the remainder is not positive (counted in `summary`). The trainer fits the
  overhead leaf to every measured root instead (`campaign_train`); these check it.

Inner nodes other than the root (layers, a collective's node) are sums, not measured. The
times of a sampled step's nodes include replays and are set to NaN.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vllm_piep.datasets.model import DatasetError, TreeDataset
from vllm_piep.datasets.spans import load_span_dataset
from vllm_piep.meters.log import LoggedMeter, read_meter_log
from vllm_piep.meters.windows import span_energy
from vllm_piep.model.flops import StepTotals
from vllm_piep.predict.served import SERVE_FEATURES, StepTemplate, step_nodes, template_of
from vllm_piep.spans.reader import SpanSet, read_span_file, span_files
from vllm_piep.spans.treemap import collective_nodes, header_shape, merged_tree

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
MIN_RESOLUTIONS = 5  # a shape's steps must last this many meter resolutions to be measured
MIN_WINDOW_RESOLUTIONS = 3  # and a repeated-sampling window this many
OVERHEAD = "overhead"
# Serve-path features (`predict.served`) the loader does not make, and the step totals they
# come from besides the loader's token counts (so that they can be recomputed from the data).
EXTRA_FEATURES = ("calls", "wait_s", "tokens", "attended_pairs", "sampled_rows",
                  "worker_s", "observed_wait_j")


@dataclass
class CampaignData:
    dataset: TreeDataset
    samples: pd.DataFrame  # one row per repeated-sampling window
    sync: pd.DataFrame  # wait-time quantiles per configuration and collective op
    static: pd.DataFrame  # idle power per attempt
    summary: dict[str, Any]

    def save(self, directory: Path) -> None:
        self.dataset.save(directory)
        self.samples.to_parquet(directory / "samples.parquet", index=False)
        self.sync.to_parquet(directory / "sync.parquet", index=False)
        self.static.to_parquet(directory / "static.parquet", index=False)
        (directory / "summary.json").write_text(json.dumps(self.summary, indent=1))

    @classmethod
    def load(cls, directory: Path) -> CampaignData:
        return cls(TreeDataset.load(directory), pd.read_parquet(directory / "samples.parquet"),
                   pd.read_parquet(directory / "sync.parquet"),
                   pd.read_parquet(directory / "static.parquet"),
                   json.loads((directory / "summary.json").read_text()))


# --------------------------------------------------------------------------- meter windows
@dataclass
class _Meter:
    meter: LoggedMeter
    readings: list[Any]
    label: str

    @classmethod
    def read(cls, path: Path) -> _Meter:
        header, readings = read_meter_log(path)
        if len(readings) < 2:
            raise DatasetError(f"{path}: fewer than two meter readings")
        return cls(LoggedMeter(header, readings), readings,
                   f"{header.meter} ({header.source})")

    @property
    def resolution_s(self) -> float:
        return float(self.meter.resolution_s)

    def joules(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Energy over each window (all devices), NaN where the log does not cover it."""
        frame = pd.DataFrame({"a": np.asarray(start, np.int64), "b": np.asarray(end, np.int64)})
        if frame.empty:
            return np.zeros(0)
        e = span_energy(frame, self.readings, self.meter, start="a", end="b")
        return np.where(e["covered"].to_numpy(bool), e["total"].to_numpy(float), np.nan)


# --------------------------------------------------------------------------- one attempt
@dataclass
class _Attempt:
    config: str
    attempt: int
    directory: Path
    idle: dict[str, Any]
    cells: list[dict[str, Any]]


def _attempts(out: Path, state: dict[str, Any]) -> list[_Attempt]:
    found = []
    for config, entry in state["configs"].items():
        for a in entry.get("attempts", []):
            cells = [dict(c, cell=name) for name, c in entry.get("cells", {}).items()
                     if c["attempt"] == a["attempt"]]
            if cells:
                found.append(_Attempt(config, int(a["attempt"]), out / a["dir"],
                                      a.get("idle") or {}, cells))
    return found


def _in_cells(steps: pd.DataFrame, cells: list[dict[str, Any]]) -> pd.Series:
    """The cell name of each step that lies inside a done cell's window (else None)."""
    cell = pd.Series([None] * len(steps), index=steps.index, dtype=object)
    for c in cells:
        inside = (steps["start_ns"] >= c["start_ns"]) & (steps["end_ns"] <= c["end_ns"])
        cell[inside] = c["cell"]
    return cell


class _AttemptData:
    def __init__(self, att: _Attempt):
        self.att = att
        spans_dir = att.directory / "spans"
        paths = span_files(spans_dir)
        if not paths:
            raise DatasetError(f"{spans_dir}: no span files")
        self.spans = SpanSet.from_files([read_span_file(p) for p in paths])
        self.meter = _Meter.read(att.directory / "meter.jsonl")
        self.tree = merged_tree(self.spans)
        self.instance = self.spans.files[0].header.instance
        s = self.spans.steps
        # One row per step: the hull over ranks, the longest replay time of any rank.
        steps = s.groupby("step").agg(start_ns=("start_ns", "min"), end_ns=("end_ns", "max"),
                                      replay_ns=("replay_ns", "max"),
                                      num_reqs=("num_reqs", "first"),
                                      prefill=("prefill_tokens", "first"),
                                      decode=("decode_tokens", "first")).reset_index()
        steps = steps[(steps.prefill + steps.decode) > 0]
        steps["cell"] = _in_cells(steps, att.cells)
        self.steps = steps[steps.cell.notna()].reset_index(drop=True)
        self.idle_w = self._idle_watts()

    def tree_id(self, step: int) -> str:
        return f"spans/{self.instance}/dp0/step{step}"

    def _idle_watts(self) -> float:
        idle = self.att.idle
        if not idle:
            raise DatasetError(f"{self.att.directory}: no idle window recorded")
        e = self.meter.joules(np.array([idle["start_ns"]]), np.array([idle["end_ns"]]))[0]
        seconds = (idle["end_ns"] - idle["start_ns"]) / 1e9
        if not np.isfinite(e) or seconds < MIN_RESOLUTIONS * self.meter.resolution_s:
            raise DatasetError(f"{self.att.directory}: the idle window ({seconds:.2f} s) is not "
                               "covered by the meter log or is too short for its resolution")
        return float(e / seconds)

    # -- repeated sampling ----------------------------------------------------------------
    def samples(self) -> pd.DataFrame:
        sm = self.spans.samples
        sm = sm[sm.step.isin(self.steps.step)]
        if sm.empty:
            return pd.DataFrame({"config": pd.Series(dtype=str), "tree_id": pd.Series(dtype=str),
                                 "node_id": pd.Series(dtype=object),
                                 "target": pd.Series(dtype=str),
                                 **{c: pd.Series(dtype=float) for c in (
                                     "calls", "window", "seconds", "joules_per_call")}})
        keys = ["step", "target", "node", "op", "group", "seq", "window"]
        hull = (sm.fillna({"op": "", "group": "", "seq": -1})
                .groupby(keys).agg(start_ns=("start_ns", "min"), end_ns=("end_ns", "max"),
                                   calls=("calls", "max")).reset_index())
        seconds = (hull.end_ns - hull.start_ns) / 1e9
        dynamic = self.meter.joules(hull.start_ns, hull.end_ns) - self.idle_w * seconds
        # a window shorter than a few meter readings is interpolation, not a measurement
        resolved = seconds >= MIN_WINDOW_RESOLUTIONS * self.meter.resolution_s
        hull["seconds"] = seconds
        hull["joules_per_call"] = np.where(resolved, dynamic / hull.calls, np.nan)
        hull["node_id"] = self._sample_nodes(hull)
        hull["tree_id"] = [self.tree_id(int(s)) for s in hull.step]
        hull["config"] = self.att.config
        return hull[["config", "tree_id", "node_id", "target", "calls", "window", "seconds",
                     "joules_per_call"]]

    def _sample_nodes(self, hull: pd.DataFrame) -> list[str | None]:
        """Module samples: their node; collective samples: the `/transfer` child of the
        communication node of the call they repeat (matched by group and seq)."""
        colls = self.spans.collectives
        comm = collective_nodes(self.tree, colls)
        # (group, seq) repeats across pipeline stages (every stage's TP group is "tp:0"):
        # the module the call ran inside tells them apart
        by_call = {(g, int(q), e): n for g, q, e, n in zip(colls.group, colls.seq, colls.node,
                                                           comm) if n is not None}
        out: list[str | None] = []
        for r in hull.itertuples():
            if r.target == "module":
                out.append(str(r.node))
            else:
                node = by_call.get((r.group, int(r.seq), r.node))
                out.append(f"{node}/transfer" if node else None)
        return out

    # -- synchronization sampling ---------------------------------------------------------
    def waits(self) -> pd.DataFrame:
        """Per-rank wait of every collective call in unsampled in-cell steps."""
        colls = self.spans.collectives
        if colls.empty:
            return pd.DataFrame(columns=["config", "op", "wait_s"])
        plain = self.steps.step[self.steps.replay_ns == 0]
        c = colls[colls.step.isin(plain) & ~colls.op.isin(["send", "recv"])]
        return pd.DataFrame({"config": self.att.config, "op": c.op.to_numpy(),
                             "wait_s": c.wait_ns.to_numpy(float) / 1e9})

    # -- step energies --------------------------------------------------------------------
    def step_energy(self) -> pd.Series:
        """Dynamic energy of each step (index: step), by shapes (module doc)."""
        st = self.steps.sort_values("step").reset_index(drop=True)
        joules = self.meter.joules(st.start_ns, st.end_ns)
        return pooled_step_energy(st, np.asarray(joules, float), self.idle_w,
                                  MIN_RESOLUTIONS * self.meter.resolution_s)


def pooled_step_energy(steps: pd.DataFrame, joules: np.ndarray, idle_w: float,
                       floor_s: float) -> pd.Series:
    """Each step's dynamic energy (index: step): the power its pool's unsampled steps drew
    over their own time (meter `joules` minus `idle_w`), times its own time. A pool is the
    step's shape (requests, prefill or decode) when that shape's unsampled steps last
    `floor_s` in all; else its kind (prefill or decode) over all batch sizes; else every step
    (fast steps of a small model under a coarse meter); NaN if even that is too short. A
    sampled step's own time is not clean: a rank that finished its replays early waits at the
    next collective for the others. It gets its shape's median unsampled time (NaN if its
    shape has no unsampled step)."""
    own = ((steps.end_ns - steps.start_ns - steps.replay_ns) / 1e9).to_numpy(float)
    plain = (steps.replay_ns == 0).to_numpy()
    dynamic = joules - idle_w * own
    prefill = (steps.prefill > 0).to_numpy()
    shape = steps.groupby(["num_reqs", prefill]).ngroup().to_numpy()
    typical = pd.Series(np.where(plain, own, np.nan)).groupby(shape).transform("median")
    time_s = np.where(plain, own, typical.to_numpy())
    energy = np.full(len(steps), np.nan)
    left = np.ones(len(steps), bool)
    for pools in (shape, prefill.astype(int), np.zeros(len(steps), int)):
        for k in np.unique(pools[left]):
            rows = pools == k
            measured = rows & plain
            seconds = float(own[measured].sum())
            if seconds < floor_s or not np.isfinite(dynamic[measured]).all():
                continue
            power = float(dynamic[measured].sum()) / seconds
            energy[rows & left] = power * time_s[rows & left]
            left &= ~rows
    return pd.Series(energy, index=steps.step.to_numpy())


# --------------------------------------------------------------------------- assembly
def _from_campaign(sources: pd.Series, out: Path) -> pd.Series:
    """Each row's span file named from the campaign directory (`runs/...`), so that a campaign
    moved or copied elsewhere still names its files; a file outside it keeps its path."""
    root = Path(out).resolve()

    def relative(source: object) -> object:
        if not isinstance(source, str) or not source:
            return source
        path = Path(source).resolve()
        return str(path.relative_to(root)) if path.is_relative_to(root) else source

    return sources.map({s: relative(s) for s in sources.unique()})


def build_campaign_data(out: Path, state: dict[str, Any]) -> CampaignData:
    """The dataset of every done cell of the campaign in `out` (state: `campaign.json`)."""
    attempts = [_AttemptData(att) for att in _attempts(out, state)]
    if not attempts:
        raise DatasetError(f"{out}: no done cell with span files: nothing to build")
    waits = pd.concat([a.waits() for a in attempts], ignore_index=True)
    sync = sync_quantiles(waits)
    node_frames, tree_frames, sample_frames, static_rows = [], [], [], []
    issues = []
    warnings: list[str] = []
    features: tuple[str, ...] = ()
    for data in attempts:
        att = data.att
        ds = load_span_dataset(att.directory / "spans", meter_log=att.directory / "meter.jsonl")
        issues += ds.issues
        features = ds.features
        keep = {data.tree_id(int(s)): c for s, c in zip(data.steps.step, data.steps.cell)}
        nodes = ds.nodes[ds.nodes.tree_id.isin(keep)].copy()
        trees = ds.trees[ds.trees.tree_id.isin(keep)].copy()
        cells = {c["cell"]: c for c in att.cells}
        trees["group"] = [f"{att.config}/{keep[t]}" for t in trees.tree_id]
        trees["batch_size"] = [float(cells[keep[t]]["batch"]) for t in trees.tree_id]
        trees["seq_len"] = [float(cells[keep[t]]["out_len"]) for t in trees.tree_id]
        samples = data.samples()
        sample_frames.append(samples)
        mine = sync[sync.config == att.config]
        wait_by_op = dict(zip(mine.op, mine.mean_s))
        nodes = _serve_features(_with_overhead_rows(nodes), data, wait_by_op)
        nodes, unpriced = _with_energies(nodes, data, samples)
        if unpriced:
            warnings.append(unpriced)
        node_frames.append(_overhead_remainder(nodes))
        tree_frames.append(trees)
        static_rows.append({"config": att.config, "attempt": att.attempt,
                            "idle_watts": data.idle_w, "meter": data.meter.label,
                            "resolution_s": data.meter.resolution_s})
    all_samples = pd.concat(sample_frames, ignore_index=True)
    if all_samples.empty:
        raise DatasetError(f"{out}: no repeated-sampling windows in any span file: the module "
                           "leaves are unmeasured (was the campaign run with `sampling`?)")
    nodes = pd.concat(node_frames, ignore_index=True)
    nodes["source"] = _from_campaign(nodes["source"], out)
    trees = pd.concat(tree_frames, ignore_index=True)
    ds = TreeDataset.from_frames("campaign", nodes, trees,
                                 (*features, *EXTRA_FEATURES, "energy_source"), issues)
    return CampaignData(ds, all_samples, sync, pd.DataFrame(static_rows),
                        {**_summary(ds), "warnings": warnings})


def _serve_features(nodes: pd.DataFrame, data: _AttemptData,
                    wait_by_op: dict[str, float]) -> pd.DataFrame:
    """The serve path's features (`predict.served.step_nodes`) on every node, replacing the
    loader's per-rank work: what the bundle is trained on is what it will be given."""
    shape = header_shape(data.spans)
    if shape is None:
        raise DatasetError(f"{data.att.directory}: span headers without the model shape")
    steps = data.spans.steps
    first = steps[steps["rank"] == steps["rank"].min()].set_index("step")
    step_of = {data.tree_id(int(s)): int(s) for s in data.steps.step}
    templates: dict[tuple[str, ...], StepTemplate] = {}
    nodes = nodes.copy()
    for tree_id, g in nodes.groupby("tree_id", sort=False):
        r = first.loc[step_of[tree_id]]
        ids = tuple(g.node_id)
        if ids not in templates:
            templates[ids] = StepTemplate.build(template_of(g))
        f = step_nodes(templates[ids], shape, StepTotals(
            tokens=float(r.prefill_tokens + r.decode_tokens),
            attended_pairs=float(r.attended_pairs), context_tokens=float(r.context_tokens),
            sampled_rows=float(r.sampled_rows)), float(r.num_reqs), wait_by_op)
        nodes.loc[g.index, list(SERVE_FEATURES)] = f[list(SERVE_FEATURES)].to_numpy()
        nodes.loc[g.index, "attended_pairs"] = float(r.attended_pairs)
        nodes.loc[g.index, "sampled_rows"] = float(r.sampled_rows)
        # the step time the serve path reads (the worker's own calls), replays included
        nodes.loc[g.index, "worker_s"] = float(r.worker_ns) / 1e9
    return nodes


def sync_quantiles(waits: pd.DataFrame) -> pd.DataFrame:
    """Wait-time quantiles per configuration and op (seconds), with their mean and count."""
    rows = []
    for (config, op), g in waits.groupby(["config", "op"]):
        w = g.wait_s.to_numpy(float)
        rows.append({"config": config, "op": op, "n": int(len(w)), "mean_s": float(w.mean()),
                     **{f"q{int(q * 100):02d}_s": float(np.quantile(w, q)) for q in QUANTILES}})
    cols = ["config", "op", "n", "mean_s", *(f"q{int(q * 100):02d}_s" for q in QUANTILES)]
    return pd.DataFrame(rows, columns=cols)


def _with_energies(nodes: pd.DataFrame, data: _AttemptData,
                   samples: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """The nodes with their measured energies (`energy_j`, `energy_source`), and a one-line
    warning when the attempt's synchronization waits get none because its collective replays
    measured no power above idle."""
    nodes = nodes.copy()
    nodes["energy_j"] = np.nan
    nodes["energy_source"] = ""
    nodes["tokens"] = nodes.prefill_tokens + nodes.decode_tokens
    # a sampled step's times include replays, and other ranks' replays as waits
    step_of = {data.tree_id(int(s)): int(s) for s in data.steps.step}
    sampled = set(data.steps.step[data.steps.replay_ns > 0])
    inflated = np.array([step_of[t] in sampled for t in nodes.tree_id])
    nodes.loc[inflated, "time_s"] = np.nan
    # replayed leaves
    per_node = samples.dropna(subset=["node_id"]).groupby(["tree_id", "node_id"])[
        "joules_per_call"].mean()
    key = pd.MultiIndex.from_arrays([nodes.tree_id, nodes.node_id])
    replayed = per_node.reindex(key).to_numpy()
    ok = np.isfinite(replayed) & (replayed > 0)
    nodes.loc[ok, "energy_j"] = replayed[ok]
    nodes.loc[ok, "energy_source"] = "replay"
    _exclude_nested_collectives(nodes)
    # waits: measured time x the collective replays' dynamic power
    coll = samples[(samples.target == "collective") & samples.joules_per_call.notna()]
    seconds = float(coll.seconds.sum())
    wait_power = float((coll.joules_per_call * coll.calls).sum()) / seconds if seconds else np.nan
    is_wait = (nodes.type == "wait").to_numpy()
    nodes["observed_wait_j"] = np.nan
    unpriced = None
    if is_wait.any() and not (np.isfinite(wait_power) and wait_power > 0):
        why = (f"measured {wait_power:.3g} W above idle over {seconds:.2f} s (another "
               "process loading this machine during the campaign lowers what they measure)"
               if seconds else "were not measured")
        unpriced = (f"{data.att.config} attempt {data.att.attempt}: the collective replays "
                    f"{why}, so its {int(is_wait.sum())} synchronization waits carry no energy")
    elif is_wait.any():
        observed = nodes.time_s.to_numpy(float) * wait_power
        nodes.loc[is_wait, "observed_wait_j"] = observed[is_wait]
        expected = nodes.wait_s.to_numpy(float) * wait_power
        good = is_wait & (expected > 0)
        nodes.loc[good, "energy_j"] = expected[good]
        nodes.loc[good, "energy_source"] = "sync-sampling"
    # roots
    energy = data.step_energy()
    is_root = (nodes.parent_id == "").to_numpy()
    root_e = np.array([energy.get(step_of[t], np.nan) for t in nodes.tree_id])
    good = is_root & np.isfinite(root_e) & (root_e > 0)
    nodes.loc[good, "energy_j"] = root_e[good]
    nodes.loc[good, "energy_source"] = "window"
    return nodes, unpriced


def _exclude_nested_collectives(nodes: pd.DataFrame) -> None:
    """A replayed module runs its tensor-parallel collective too (vLLM's row-parallel layers
    and vocab-parallel embedding all-reduce inside the module), which the collective's own
    replay measures as its transfer: the module's leaf is what remains, so that the tree does
    not count the collective twice. NaN where that is not positive."""
    transfer = nodes[(nodes.type == "transfer") & nodes.energy_j.notna()]
    module = transfer.node_id.str.split("@").str[0]
    nested = pd.Series(transfer.energy_j.to_numpy(),
                       index=pd.MultiIndex.from_arrays([transfer.tree_id, module]))
    nested = nested.groupby(level=[0, 1]).sum()
    key = pd.MultiIndex.from_arrays([nodes.tree_id, nodes.node_id])
    inside = nested.reindex(key).to_numpy()
    has = np.isfinite(inside) & (nodes.energy_source == "replay").to_numpy()
    own = nodes.energy_j.to_numpy(float) - np.where(has, inside, 0.0)
    nodes.loc[has, "energy_j"] = np.where(own[has] > 0, own[has], np.nan)
    # a module whose collective was not measured cannot be separated from it
    colls = nodes[nodes.type == "transfer"].node_id.str.split("@").str[0]
    with_coll = set(zip(nodes.loc[colls.index, "tree_id"], colls))
    unresolved = np.array([(t, n) in with_coll for t, n in zip(nodes.tree_id, nodes.node_id)]
                          ) & ~has & (nodes.energy_source == "replay").to_numpy()
    nodes.loc[unresolved, "energy_j"] = np.nan
    nodes.loc[nodes.energy_j.isna(), "energy_source"] = ""


def _with_overhead_rows(nodes: pd.DataFrame) -> pd.DataFrame:
    """One `overhead` leaf under each root (its features: `_serve_features`)."""
    rows = nodes[nodes.parent_id == ""].copy()
    rows["parent_id"] = rows.node_id
    for col, value in (("node_id", OVERHEAD), ("scope", OVERHEAD), ("type", OVERHEAD),
                       ("level", "module"), ("component", "static"), ("time_s", np.nan),
                       ("device_energy_j", np.nan), ("energy_j", np.nan)):
        rows[col] = value
    return pd.concat([nodes, rows], ignore_index=True)


def _overhead_remainder(nodes: pd.DataFrame) -> pd.DataFrame:
    """The overhead leaf's energy where a step's root and leaves are known: the root minus all
    other leaves. A leaf left unmeasured (its replay drew no more than idle power) counts as
    the mean of its type in the same step (the layers are alike); with a type unmeasured the
    remainder is NaN."""
    roots = nodes[nodes.parent_id == ""].set_index("tree_id")
    parents = set(zip(nodes.tree_id, nodes.parent_id))
    is_leaf = np.array([(t, n) not in parents for t, n in zip(nodes.tree_id, nodes.node_id)])
    leaves = nodes[is_leaf & (nodes.node_id != OVERHEAD).to_numpy()]
    by_type = leaves.groupby(["tree_id", "type"]).energy_j.transform("mean")
    filled = leaves.energy_j.fillna(by_type)
    leaf_sum = filled.groupby(leaves.tree_id).sum(min_count=1)
    leaf_known = filled.notna().groupby(leaves.tree_id).all()
    remainder = roots.energy_j - leaf_sum.reindex(roots.index)
    remainder = remainder.where(leaf_known.reindex(roots.index).fillna(False).astype(bool)
                                & (remainder > 0))
    over = (nodes.node_id == OVERHEAD).to_numpy()
    value = nodes.tree_id.map(remainder).to_numpy(float)
    nodes = nodes.copy()
    nodes.loc[over, "energy_j"] = value[over]
    nodes.loc[over & np.isfinite(value), "energy_source"] = "remainder"
    return nodes


def _summary(ds: TreeDataset) -> dict[str, Any]:
    n = ds.nodes
    metered = n[n.energy_j.notna()]
    roots = n[n.parent_id == ""]
    over = n[n.node_id == OVERHEAD]
    return {
        "trees": int(len(ds.trees)),
        "configs": sorted({g.split("/")[0] for g in ds.trees.group}),
        "cells": sorted(set(ds.trees.group)),
        # "metered": energies from the meter's log, whatever its source (measured, estimated
        # or simulated: the report's header names it)
        "metered_nodes_by_source": metered.energy_source.value_counts().to_dict(),
        "metered_leaves_by_type": metered[metered.energy_source.isin(
            ["replay", "sync-sampling", "remainder"])].type.value_counts().to_dict(),
        "roots_metered": int(roots.energy_j.notna().sum()),
        # sampled steps with a metered root whose remainder is unknown or not positive
        "overhead_unresolved_or_negative": int(
            (roots.tree_id.isin(set(n.tree_id[n.energy_source == "replay"])).to_numpy()
             & roots.energy_j.notna().to_numpy()
             & over.set_index("tree_id").energy_j.reindex(roots.tree_id).isna().to_numpy()
             ).sum()),
        "bad_rows": len(ds.issues),
        "waits_without_energy": int(((n.type == "wait") & n.energy_j.isna()).sum()),
    }
