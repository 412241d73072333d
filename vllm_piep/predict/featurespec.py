"""The feature matrix a regressor sees: named columns computed from a node table.

One `FeatureSpec` is stored in a bundle's manifest and evaluated the same way at training and at
prediction time, so the ONNX graphs only ever see the matrix this builds. A column is either a
node feature (`time_s`), a product of two (`gpu_util_pct*time_s`: an intensive quantity times a
duration is an energy-like term, the form of IrEne's resource features inside a linear model), or
a log (`log:active_params_b`, for log-linear regressors). No scikit-learn or vLLM imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


class FeatureSchemaError(ValueError):
    """The features a regressor needs are not in the input."""


@dataclass(frozen=True)
class FeatureSpec:
    columns: tuple[str, ...]

    @staticmethod
    def parse(column: str) -> tuple[str, tuple[str, ...]]:
        """('product', (a, b)) | ('log', (a,)) | ('log1p', (a,)) | ('raw', (a,))."""
        if column.startswith("log:"):
            return "log", (column[4:],)
        if column.startswith("log1p:"):
            return "log1p", (column[6:],)
        if "*" in column:
            a, b = column.split("*", 1)
            return "product", (a, b)
        return "raw", (column,)

    @property
    def inputs(self) -> tuple[str, ...]:
        """The node features this spec reads, in first-use order."""
        seen: dict[str, None] = {}
        for c in self.columns:
            for name in self.parse(c)[1]:
                seen[name] = None
        return tuple(seen)

    def products(self) -> tuple[str, ...]:
        """The product columns (`a*b`): energy-like terms a node table may hold precomputed
        (a synthetic `self` node's terms are differences of products, not products)."""
        return tuple(c for c in self.columns if self.parse(c)[0] == "product")

    def matrix(self, table: Mapping[str, Sequence[float] | np.ndarray]) -> np.ndarray:
        """float64 [n, len(columns)] from a mapping of feature name -> column (a DataFrame
        works). Raises `FeatureSchemaError` naming every missing feature."""
        need = {name for c in self.columns if c not in table for name in self.parse(c)[1]}
        missing = [name for name in self.inputs if name in need and name not in table]
        if missing:
            raise FeatureSchemaError(f"missing features {missing} (this regressor reads "
                                     f"{list(self.inputs)})")
        cols = {name: np.asarray(table[name], dtype=np.float64)
                for name in self.inputs if name in table}
        out = []
        for c in self.columns:
            kind, args = self.parse(c)
            if kind == "product" and c in table:  # precomputed (see `products`)
                out.append(np.asarray(table[c], dtype=np.float64))
                continue
            if kind == "product":
                out.append(cols[args[0]] * cols[args[1]])
            elif kind == "log":
                out.append(np.log(np.maximum(cols[args[0]], 1e-12)))
            elif kind == "log1p":
                out.append(np.log1p(np.maximum(cols[args[0]], 0.0)))
            else:
                out.append(cols[args[0]])
        if not out:
            return np.zeros((len(table[next(iter(table))]) if len(table) else 0, 0))
        return np.column_stack(out)

    def to_dict(self) -> dict[str, list[str]]:
        return {"columns": list(self.columns)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Sequence[str]]) -> FeatureSpec:
        return cls(tuple(data["columns"]))
