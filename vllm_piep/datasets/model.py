"""The tree-structured energy dataset every loader produces and the trainer consumes.

A dataset is a set of trees, one per model x input configuration x parallel configuration.
Each node has a level (ml, module, communication, model), a type (`Linear`, `BertLayer`,
`attention`, `allreduce`...), a scope (its place in the model, unique in its tree), a component
(the `COMPONENTS` bucket its energy falls into), features and, where it was measured, its
energy in joules. Nodes and trees are two pandas frames so that training and evaluation work
column-wise; `TreeDataset.validate` checks the invariants once, after loading.

Bad input rows are never dropped silently: loaders report each one (`RowIssue`: file, line,
reason) to an `IssueLog`, which either keeps them as skipped rows on the dataset or, with
`BadRows.REJECT`, raises `DatasetError` listing all of them.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd


class Level(enum.StrEnum):
    ML = "ml"
    MODULE = "module"
    COMMUNICATION = "communication"
    MODEL = "model"


LEVELS: tuple[str, ...] = tuple(lv.value for lv in Level)  # leaves to root: report order


class BadRows(enum.StrEnum):
    SKIP = "skip"      # report each bad row and go on without it
    REJECT = "reject"  # report all bad rows, then refuse the file


# Node columns every dataset has; features come after them. `parent_id` is "" for a root.
NODE_COLUMNS: tuple[str, ...] = (
    "tree_id", "node_id", "parent_id", "level", "type", "scope", "component", "energy_j",
    "source", "line",
)
# Tree columns; numeric ones are NaN where a dataset does not know them.
TREE_COLUMNS: tuple[str, ...] = (
    "tree_id", "dataset", "model", "group", "hardware", "batch_size", "seq_len", "tp", "pp", "dp",
)


class DatasetError(ValueError):
    """A dataset file that cannot be used as it is; the message names file and line."""


def read_csv_table(path: str | Path, **options: object) -> pd.DataFrame:
    """`pd.read_csv` of a file that must be a CSV table with a header: a missing, empty,
    binary or malformed file is a `DatasetError` naming it, not a pandas traceback."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p}: missing" + (" (a directory, expected a CSV file)"
                                               if p.is_dir() else ""))
    try:
        table = pd.read_csv(p, **options)  # type: ignore[call-overload]
    except pd.errors.EmptyDataError:
        raise DatasetError(f"{p}: empty, expected a CSV table with a header line") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetError(f"{p}: not a readable CSV table ({first})") from None
    if table.empty:
        raise DatasetError(f"{p}: a header but no data rows")
    return table


@dataclass(frozen=True)
class RowIssue:
    file: str
    line: int  # 1-based line in the file (the header is line 1); 0 for a whole-tree issue
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass
class IssueLog:
    """Collects bad rows while a loader runs; `close()` raises under `BadRows.REJECT`."""

    policy: BadRows = BadRows.SKIP
    issues: list[RowIssue] = field(default_factory=list)

    def report(self, file: str | Path, line: int, reason: str) -> None:
        self.issues.append(RowIssue(str(file), int(line), reason))

    def close(self) -> list[RowIssue]:
        if self.issues and self.policy is BadRows.REJECT:
            shown = "\n  ".join(str(i) for i in self.issues[:20])
            more = f"\n  ... and {len(self.issues) - 20} more" if len(self.issues) > 20 else ""
            raise DatasetError(f"{len(self.issues)} bad rows (rejected, --bad-rows reject):"
                               f"\n  {shown}{more}")
        return list(self.issues)


@dataclass
class TreeDataset:
    """Trees of energy nodes. `features` names the node feature columns (units in the names)."""

    name: str
    nodes: pd.DataFrame
    trees: pd.DataFrame
    features: tuple[str, ...]
    issues: list[RowIssue] = field(default_factory=list)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_frames(cls, name: str, nodes: pd.DataFrame, trees: pd.DataFrame,
                    features: Sequence[str], issues: Iterable[RowIssue] = ()) -> TreeDataset:
        nodes = nodes.reset_index(drop=True)
        for col in NODE_COLUMNS:
            if col not in nodes:
                nodes[col] = "" if col in ("parent_id", "source", "component") else np.nan
        nodes["level"] = [str(v) for v in nodes.level]
        trees = trees.reset_index(drop=True)
        for col in TREE_COLUMNS:
            if col not in trees:
                trees[col] = np.nan if col in ("batch_size", "seq_len", "tp", "pp", "dp") else ""
        ds = cls(name, nodes[list(NODE_COLUMNS) + [f for f in features if f not in NODE_COLUMNS]],
                 trees[list(TREE_COLUMNS)], tuple(features), list(issues))
        ds.validate()
        return ds

    def validate(self) -> None:
        """Every tree has one root of level `model`; node ids are unique in a tree; every
        parent exists in its tree; measured energies are positive; every node's tree exists."""
        n = self.nodes
        if n.duplicated(["tree_id", "node_id"]).any():
            dup = n[n.duplicated(["tree_id", "node_id"], keep=False)].iloc[0]
            raise DatasetError(f"{self.name}: node {dup.node_id!r} twice in tree {dup.tree_id!r}")
        unknown = set(n.tree_id) - set(self.trees.tree_id)
        if unknown:
            raise DatasetError(f"{self.name}: nodes of unknown trees {sorted(unknown)[:5]}")
        roots = n[n.parent_id == ""]
        per_tree = roots.groupby("tree_id").size()
        bad = set(self.trees.tree_id) - set(per_tree[per_tree == 1].index)
        if bad:
            raise DatasetError(f"{self.name}: trees without exactly one root: {sorted(bad)[:5]}")
        if (roots.level != Level.MODEL).any():
            raise DatasetError(f"{self.name}: a root that is not a model node")
        keys = set(zip(n.tree_id, n.node_id))
        inner = n[n.parent_id != ""]
        orphans = [(t, p) for t, p in zip(inner.tree_id, inner.parent_id) if (t, p) not in keys]
        if orphans:
            raise DatasetError(f"{self.name}: parents missing from their tree: {orphans[:5]}")
        energy = n.energy_j.to_numpy(dtype=float)
        if (energy[~np.isnan(energy)] <= 0).any():
            raise DatasetError(f"{self.name}: a measured energy that is not positive")
        levels = set(n.level) - {lv.value for lv in Level}
        if levels:
            raise DatasetError(f"{self.name}: unknown levels {sorted(levels)}")

    # -- views --------------------------------------------------------------------------------
    @property
    def models(self) -> list[str]:
        return sorted(self.trees.model.unique())

    def subset(self, tree_ids: Iterable[str]) -> TreeDataset:
        keep = set(tree_ids)
        return TreeDataset(self.name, self.nodes[self.nodes.tree_id.isin(keep)].reset_index(
            drop=True), self.trees[self.trees.tree_id.isin(keep)].reset_index(drop=True),
            self.features, self.issues)

    def where_model(self, models: Iterable[str], keep: bool = True) -> TreeDataset:
        chosen = self.trees.model.isin(set(models))
        return self.subset(self.trees.tree_id[chosen if keep else ~chosen])

    def with_tree_columns(self, columns: Sequence[str] = ("model",)) -> pd.DataFrame:
        """Nodes joined with some tree columns (for grouping results by model)."""
        return self.nodes.merge(self.trees[["tree_id", *columns]], on="tree_id", how="left")

    def summary(self) -> dict[str, object]:
        return {"name": self.name, "trees": int(len(self.trees)), "nodes": int(len(self.nodes)),
                "models": self.models, "levels": self.nodes.level.value_counts().to_dict(),
                "bad_rows": len(self.issues)}

    # -- files --------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """`nodes.parquet`, `trees.parquet` and `dataset.json` (name, features, bad rows)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.nodes.to_parquet(out / "nodes.parquet", index=False)
        self.trees.to_parquet(out / "trees.parquet", index=False)
        meta = {"schema": "piep.dataset/1", "name": self.name, "features": list(self.features),
                "issues": [vars(i) for i in self.issues]}
        (out / "dataset.json").write_text(json.dumps(meta, indent=1))
        return out

    @classmethod
    def load(cls, directory: str | Path) -> TreeDataset:
        src = Path(directory)
        meta_path = src / "dataset.json"
        if not meta_path.is_file():
            raise DatasetError(f"{src}: not a saved dataset (no dataset.json)")
        meta = json.loads(meta_path.read_text())
        if meta.get("schema") != "piep.dataset/1":
            raise DatasetError(f"{meta_path}: schema {meta.get('schema')!r}, "
                               "expected 'piep.dataset/1'")
        issues = [RowIssue(**i) for i in meta.get("issues", [])]
        return cls.from_frames(meta["name"], pd.read_parquet(src / "nodes.parquet"),
                               pd.read_parquet(src / "trees.parquet"), meta["features"], issues)
