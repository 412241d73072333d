"""IrEne's released measurements (`irene/device_1/*_level_features.csv`) as a `TreeDataset`.

Four CSVs hold the levels: `model_level_features.csv`, `module_level_features.csv` and the ML
primitives in `ml1_level_features.csv` (modules such as `Linear`, `LayerNorm`) and
`ml2_level_features.csv` (functional ops, `MatMul` and `Softmax`, recorded under the scope of the
module that calls them). Each row is one node of one tree: (model, batch size, sequence length).
`level_name` is `scope:Type`; the tree is rebuilt from the scopes: a node's parent is the module
row whose scope is the longest prefix of its own (for a functional op, its own scope), else the
model row. Columns (docs/datasets.md): flops in MFLOP, mem_bytes in MiB, times_mean in s,
gpu_energy_mean in J (NVML), energy_mean in J (wall meter: the ground truth).

A functional op that runs twice with the same shapes (the two attention MatMuls) appears as two
identical rows; both are kept, as `scope:MatMul#0` and `#1`, since both ran.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from vllm_piep.datasets.model import (
    BadRows,
    DatasetError,
    IssueLog,
    Level,
    TreeDataset,
)

FILES: dict[str, Level] = {
    "model_level_features.csv": Level.MODEL,
    "module_level_features.csv": Level.MODULE,
    "ml1_level_features.csv": Level.ML,
    "ml2_level_features.csv": Level.ML,
}
# IrEne column -> canonical feature (vllm_piep.datasets.features); flops MFLOP -> GFLOP below.
RENAME: dict[str, str] = {
    "batch_size": "batch_size", "seq_len": "seq_len", "flops": "gflop", "mem_bytes": "mem_mib",
    "cpu": "cpu_util_pct", "mem": "mem_util_pct", "gpu": "gpu_util_pct",
    "gpu_mem": "gpu_mem_util_pct", "gpu_clk": "gpu_clock_mhz",
    "gpu_mem_clk": "gpu_mem_clock_mhz", "times_mean": "time_s",
    "gpu_energy_mean": "device_energy_j",
}
FEATURES: tuple[str, ...] = tuple(RENAME.values())
REQUIRED: tuple[str, ...] = (*RENAME, "energy_mean", "level_name", "model_name")


def component_of(scope: str, type_: str) -> str:
    """The energy component of an IrEne node, from its type and scope (`COMPONENTS` names;
    containers such as `BertLayer` are `other`). These encoders have no LM head; their pooler
    (dense + tanh over the first token) is their output head, so it is counted as `logits`."""
    t, s = type_.lower(), scope.lower()
    if "embedding" in t:
        return "embedding"
    if "norm" in t:
        return "norm"
    if "pooler" in s:
        return "logits"
    if t in ("matmul", "softmax") or re.search(r"attn|attention", s):
        return "attention"
    if re.search(r"mlp|ffn|intermediate|(^|\.)output($|\.)", s):
        return "mlp"
    return "other"


def load_irene(directory: str | Path, policy: BadRows = BadRows.SKIP) -> TreeDataset:
    """Read the four level CSVs under `directory` into one dataset of trees."""
    root = Path(directory)
    log = IssueLog(policy)
    frames = []
    for name, level in FILES.items():
        path = root / name
        if not path.is_file():
            raise DatasetError(f"{path}: missing (an IrEne device directory has {sorted(FILES)})")
        frames.append(_read_level(path, level, log))
    rows = pd.concat(frames, ignore_index=True)
    nodes, trees = _build_trees(rows, log)
    issues = log.close()
    return TreeDataset.from_frames("irene", nodes, trees, FEATURES, issues)


def _read_level(path: Path, level: Level, log: IssueLog) -> pd.DataFrame:
    raw = pd.read_csv(path, dtype=str, keep_default_na=False)
    missing = [c for c in REQUIRED if c not in raw.columns]
    if missing:
        raise DatasetError(f"{path}:1: missing columns {missing}")
    df = pd.DataFrame({"line": np.arange(len(raw)) + 2, "source": str(path), "level": level})
    for col in RENAME:
        df[RENAME[col]] = pd.to_numeric(raw[col].str.strip(), errors="coerce")
    df["energy_j"] = pd.to_numeric(raw["energy_mean"].str.strip(), errors="coerce")
    df["model"] = raw["model_name"].str.strip()
    level_name = raw["level_name"].str.strip()
    if level is Level.MODEL:
        df["scope"], df["type"] = "", level_name
    else:
        parts = level_name.str.rsplit(":", n=1)
        df["scope"] = parts.str[0]
        df["type"] = parts.str[1].fillna("")
    df["gflop"] = df["gflop"] / 1e3  # MFLOP -> GFLOP
    keep = np.ones(len(df), dtype=bool)
    for i, row in enumerate(df.itertuples(index=False)):
        bad = [c for c in (*FEATURES, "energy_j") if not np.isfinite(getattr(row, c))]
        if bad:
            log.report(path, row.line, f"missing or non-numeric {bad}")
        elif row.energy_j <= 0:
            log.report(path, row.line, f"energy_mean {row.energy_j} is not positive")
        elif not row.model or (level is not Level.MODEL and (not row.scope or not row.type)):
            log.report(path, row.line, f"level_name {level_name.iloc[i]!r} is not 'scope:Type'")
        else:
            continue
        keep[i] = False
    return df[keep]


def _build_trees(rows: pd.DataFrame, log: IssueLog) -> tuple[pd.DataFrame, pd.DataFrame]:
    key = ["model", "batch_size", "seq_len"]
    rows = rows.copy()
    rows["tree_id"] = ("irene/" + rows.model + "/b" + rows.batch_size.astype(int).astype(str)
                       + "/s" + rows.seq_len.astype(int).astype(str))
    model_rows = rows[rows.level == Level.MODEL]
    dup_model = model_rows.duplicated("tree_id")
    for r in model_rows[dup_model].itertuples():
        log.report(r.source, r.line, f"a second model row for {r.tree_id}")
    model_rows = model_rows[~dup_model]
    has_root = set(model_rows.tree_id)
    orphan = ~rows.tree_id.isin(has_root)
    for r in rows[orphan].itertuples():
        log.report(r.source, r.line, f"orphan node: no model row for {r.model} batch "
                   f"{r.batch_size:g} seq {r.seq_len:g} (tree {r.tree_id})")
    rows = rows[~orphan & ((rows.level != Level.MODEL) | rows.index.isin(model_rows.index))]

    out = []
    for tree_id, g in rows.groupby("tree_id", sort=False):
        modules = g[g.level == Level.MODULE]
        dup = modules.duplicated("scope")
        for r in modules[dup].itertuples():
            log.report(r.source, r.line, f"module {r.scope!r} twice in tree {tree_id}")
        g = g.drop(modules.index[dup.to_numpy()])
        module_ids = dict(zip(g.scope[g.level == Level.MODULE],
                              g.scope[g.level == Level.MODULE] + ":"
                              + g.type[g.level == Level.MODULE]))
        seen: dict[str, int] = {}
        node_ids, parents = [], []
        for r in g.itertuples():
            if r.level == Level.MODEL:
                node_ids.append("model")
                parents.append("")
                continue
            base = f"{r.scope}:{r.type}"
            k = seen.get(base, 0)
            seen[base] = k + 1
            node_ids.append(base if r.level == Level.MODULE else f"{base}#{k}")
            parents.append(_parent(r.scope, r.level, module_ids))
        g = g.assign(node_id=node_ids, parent_id=parents)
        out.append(g)
    nodes = pd.concat(out, ignore_index=True)
    nodes["component"] = [component_of(s, t) if lv != Level.MODEL else "model"
                          for s, t, lv in zip(nodes.scope, nodes.type, nodes.level)]
    nodes["level"] = nodes.level.astype(str)
    trees = nodes[nodes.level == Level.MODEL][["tree_id", "model", *key[1:]]].copy()
    trees["dataset"], trees["group"], trees["hardware"] = "irene", "", "irene/device_1"
    trees["tp"], trees["pp"], trees["dp"] = 1.0, 1.0, 1.0
    return nodes.drop(columns=["model"]), trees


def _parent(scope: str, level: str, module_ids: dict[str, str]) -> str:
    """The node id of the closest enclosing module row, else the model root."""
    parts = scope.split(".")
    # A functional op (MatMul, Softmax) carries the scope of the module that calls it.
    start = len(parts) if level == Level.ML else len(parts) - 1
    for j in range(start, 0, -1):
        node = module_ids.get(".".join(parts[:j]))
        if node is not None:
            return node
    return "model"
