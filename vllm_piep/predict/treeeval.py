"""Bottom-up evaluation of an energy tree (IrEne Eq. 3, PIE-P Eq. 1), shared by the trainer and
the ONNX bundle runtime so both compute exactly the same sums.

Nodes are rows of flat arrays: `parent[i]` is the row of i's parent (-1 for a root), and
`depth[i]` its distance from the root. A leaf's prediction comes from its leaf regressor; an
inner node's is the sum over its children of alpha(child) * prediction(child).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


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
