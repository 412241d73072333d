"""Bottom-up evaluation of an energy tree (IrEne Eq. 3, PIE-P Eq. 1), shared by the trainer and
the ONNX bundle runtime so both compute exactly the same sums.

Nodes are rows of flat arrays: `parent[i]` is the row of i's parent (-1 for a root), and
`depth[i]` its distance from the root. A leaf's prediction comes from its leaf regressor; an
inner node's is the sum over its children of alpha(child) * prediction(child).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class TreeIndex:
    parent: np.ndarray    # int64 [n], -1 at roots
    depth: np.ndarray     # int64 [n]
    is_leaf: np.ndarray   # bool [n]: no children
    levels: tuple[np.ndarray, ...]  # row indices per depth, deepest last

    @classmethod
    def build(cls, tree_ids: Sequence[str], node_ids: Sequence[str],
              parent_ids: Sequence[str]) -> TreeIndex:
        """From node and parent ids (parent '' for a root); ids are unique within a tree."""
        n = len(node_ids)
        pos = {(t, v): i for i, (t, v) in enumerate(zip(tree_ids, node_ids))}
        parent = np.full(n, -1, dtype=np.int64)
        for i, (t, p) in enumerate(zip(tree_ids, parent_ids)):
            if p:
                parent[i] = pos[(t, p)]
        depth = np.zeros(n, dtype=np.int64)
        order = np.arange(n)
        # Depth by repeated parent hops: trees here are shallow (< 10 levels).
        cur = parent.copy()
        while (cur >= 0).any():
            live = cur >= 0
            depth[live] += 1
            cur[live] = parent[cur[live]]
        is_leaf = np.ones(n, dtype=bool)
        is_leaf[parent[parent >= 0]] = False
        levels = tuple(order[depth == d] for d in range(int(depth.max(initial=0)) + 1))
        return cls(parent, depth, is_leaf, levels)

    def aggregate(self, leaf_pred: np.ndarray, alpha: np.ndarray) -> np.ndarray:
        """Predictions of every node: leaves from `leaf_pred`, inner nodes the alpha-weighted
        sum of their children (values of `leaf_pred` at inner rows are ignored)."""
        pred = np.where(self.is_leaf, leaf_pred, 0.0).astype(np.float64)
        for rows in reversed(self.levels[1:]):
            np.add.at(pred, self.parent[rows], alpha[rows] * pred[rows])
        return pred

    def path_weight(self, alpha: np.ndarray) -> np.ndarray:
        """Product of alpha from each node up to (not including) its root: a leaf's share of
        the root's prediction is path_weight * prediction, and these shares sum to it."""
        w = np.ones(len(self.parent))
        for rows in self.levels[1:]:
            w[rows] = alpha[rows] * w[self.parent[rows]]
        return w


SELF = "self"  # level and type of the synthetic child that stands for a node's own work
LEVEL_FLAGS: tuple[str, ...] = ("ml", "module", "communication", "self")


def prepare_nodes(nodes: pd.DataFrame, products: Sequence[str], extensive: Sequence[str],
                  self_nodes: bool = True) -> pd.DataFrame:
    """The node table a predictor evaluates: product columns materialized, a `self` child
    added under every inner node, and one 0/1 column per level (`level_is_<level>`).

    A parent's measured work is more than its children's: IrEne's leaves miss element-wise ops
    (GELU, dropout, residual adds) and framework time, so children explain 53-100 % of their
    parent's energy in IrEne's data. The `self` child carries that remainder: its extensive
    features (time, device energy, FLOPs, bytes, energy-like products) are the parent's minus
    the sum of its children's, its intensive ones (utilization, clocks, sizes) the parent's.
    """
    out = nodes.copy()
    for col in products:
        a, b = col.split("*", 1)
        if col not in out:
            out[col] = out[a].to_numpy(dtype=np.float64) * out[b].to_numpy(dtype=np.float64)
    if self_nodes:
        out = pd.concat([out, _self_rows(out, [c for c in extensive if c in out])],
                        ignore_index=True)
    for level in LEVEL_FLAGS:
        out[f"level_is_{level}"] = (out.level == level).astype(np.float64)
    return out


def _self_rows(nodes: pd.DataFrame, extensive: Sequence[str]) -> pd.DataFrame:
    child = nodes[nodes.parent_id != ""]
    sums = child.groupby(["tree_id", "parent_id"])[list(extensive)].sum()
    counts = child.groupby(["tree_id", "parent_id"]).size()
    parents = nodes.set_index(["tree_id", "node_id"]).loc[counts.index]
    rows = parents.reset_index().rename(columns={"node_id": "parent_key"})
    rows[list(extensive)] = (parents[list(extensive)].to_numpy(dtype=np.float64)
                             - sums.loc[counts.index].to_numpy(dtype=np.float64))
    rows["node_id"] = rows.parent_key + "/" + SELF
    rows["parent_id"] = rows.parent_key
    rows["level"] = SELF
    rows["type"] = SELF
    rows["scope"] = rows.scope.astype(str) + "/" + SELF
    rows["component"] = rows.component.where(rows.component != "model", "other")
    rows["energy_j"] = np.nan
    return rows.drop(columns=["parent_key"])


# The buckets the model-level regressor sums leaf energies into (PIE-P Eq. 3).
MODEL_COMPONENTS: tuple[str, ...] = ("embedding", "attention", "mlp", "norm", "logits",
                                     "allreduce", "p2p", "allgather", "sync_wait", "other")


def component_matrix(nodes: pd.DataFrame, index: TreeIndex, share: np.ndarray,
                     components: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per-tree sums of leaf shares by component -> ([n_trees, n_components], root rows)."""
    roots = np.flatnonzero(index.parent < 0)
    root_of = np.arange(len(index.parent))
    for _ in index.levels[1:]:
        up = index.parent[root_of]
        root_of = np.where(up >= 0, up, root_of)
    pos = {r: i for i, r in enumerate(roots)}
    col = {c: j for j, c in enumerate(components)}
    other = col.get("other")
    X = np.zeros((len(roots), len(components)))
    leaves = np.flatnonzero(index.is_leaf & (index.parent >= 0))
    comp = nodes.component.to_numpy()
    for i in leaves:
        j = col.get(comp[i], other)
        if j is not None:
            X[pos[root_of[i]], j] += share[i]
    return X, roots


def leaf_keys(nodes: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(type key, level key) per node: `ml:Linear`, `ml:*`; every `self` node `self:*` (one
    regressor for all remainders: a remainder's energy terms mean the same at every level)."""
    level = nodes.level.astype(str).to_numpy()
    typ = nodes.type.astype(str).to_numpy()
    is_self = level == SELF
    type_key = np.where(is_self, "self:*", level + ":" + typ)
    level_key = np.where(is_self, "self:*", level + ":*")
    return type_key, level_key


def choose_leaf_key(nodes: pd.DataFrame, available: Iterable[str]) -> np.ndarray:
    """The leaf regressor each node uses: its type's, else its level's, else (a childless
    module is all its own work) the `self` one, else the ML primitives' shared one; '' if none
    fits."""
    type_key, level_key = leaf_keys(nodes)
    have = np.array(list(available), dtype=object)
    out = np.full(len(nodes), "", dtype=object)
    n = len(nodes)
    for candidate in (np.full(n, "ml:*", dtype=object), np.full(n, "self:*", dtype=object),
                      level_key, type_key):
        out = np.where(np.isin(candidate, have), candidate, out)
    return out


class UncoveredLeaves(ValueError):
    """Leaves of a level or type that no leaf regressor was trained for."""


def check_leaf_coverage(nodes: pd.DataFrame, keys: np.ndarray, is_leaf: np.ndarray) -> None:
    missing = is_leaf & (keys == "")
    if missing.any():
        what = sorted({f"{lv}:{t}" for lv, t in zip(nodes.level[missing], nodes.type[missing])})
        raise UncoveredLeaves(
            f"{int(missing.sum())} leaves have no regressor ({', '.join(what[:8])}): the "
            "training trees had no measured leaves of these levels (e.g. module spans shorter "
            "than the meter's resolution); measure them (repeated sampling) or predict with a "
            "predictor trained on them")
