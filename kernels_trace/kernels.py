"""Device work in a trace, placed in the model tree: each GPU kernel (and memcpy, memset) in the
module range that was open on the CPU thread that launched it; in a trace without GPU work,
each CPU op's own time (its children's left out) in the module range it ran in. The share of
device time that falls in a module says how much of a step's work the tree accounts for; what
falls outside is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

KERNEL_COLUMNS = ("rank", "step", "node", "type", "layer", "name", "device", "start_ns",
                  "end_ns", "ns")
TOP_OUTSIDE = 20  # kernel names outside every module, most time first


@dataclass(frozen=True)
class Work:
    """One kernel or CPU op: when it ran, and where the CPU was when it was launched (the
    thread and time whose open ranges place it; None when the trace does not tell)."""

    name: str
    device: str  # "gpu" (a kernel, memcpy or memset) or "cpu" (a CPU op)
    start_ns: int
    end_ns: int
    thread: Any = None
    anchor_ns: int | None = None
    self_ns: int | None = None  # a CPU op's own time, its children's left out

    @property
    def ns(self) -> int:
        return self.end_ns - self.start_ns if self.self_ns is None else self.self_ns


def empty_frame() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="int64" if c.endswith("ns") or c == "rank"
                                      else "object") for c in KERNEL_COLUMNS})


def coverage(frame: pd.DataFrame) -> dict[str, Any]:
    """Per rank: the device time in kernels, the share inside a module of the tree, the time
    by module type, and the kernels outside every module (name -> ns)."""
    out: dict[str, Any] = {}
    if frame.empty:
        return out
    for rank, part in frame.groupby("rank"):
        total = int(part["ns"].sum())
        inside = part[part["node"].notna()]
        outside = part[part["node"].isna()]
        names = outside.groupby("name")["ns"].sum().sort_values(ascending=False)
        out[str(rank)] = {
            "device": sorted(part["device"].unique().tolist()),
            "kernels": len(part), "total_ns": total, "in_modules_ns": int(inside["ns"].sum()),
            "share_in_modules": float(inside["ns"].sum() / total) if total else 0.0,
            "by_type_ns": {str(k): int(v) for k, v in inside.groupby("type")["ns"].sum().items()},
            "outside_modules_ns": {str(k): int(v) for k, v in names.head(TOP_OUTSIDE).items()},
            "outside_modules_names": len(names)}
    return out


def by_node(frame: pd.DataFrame) -> pd.DataFrame:
    """Kernel count and time per rank, step, node and kernel name (outside every module: node
    None)."""
    if frame.empty:
        return pd.DataFrame(columns=["rank", "step", "node", "type", "name", "count", "ns"])
    frame = frame.assign(node=frame["node"].fillna(""), type=frame["type"].fillna(""))
    table = (frame.groupby(["rank", "step", "node", "type", "name"], sort=False)["ns"]
             .agg(["count", "sum"]).reset_index().rename(columns={"sum": "ns"}))
    table["node"] = table["node"].replace("", None)
    table["type"] = table["type"].replace("", None)
    return table


def cpu_work(ops: Sequence[tuple[Any, int, int, str]]) -> list[Work]:
    """(thread, start, end, name) CPU ops as work, each with its own time: its span less its
    direct children's (an op's children run inside it on its thread), so that nothing is
    counted twice and an op that does its own work between helper calls keeps it."""
    ordered = sorted(ops, key=lambda o: (str(o[0]), o[1], -o[2]))
    children = [0] * len(ordered)
    stack: list[int] = []
    for i, (thread, start, end, _) in enumerate(ordered):
        while stack and (ordered[stack[-1]][0] != thread or ordered[stack[-1]][2] <= start):
            stack.pop()
        if stack:
            children[stack[-1]] += end - start
        stack.append(i)
    return [Work(name, "cpu", start, end, thread, start, max(0, end - start - kids))
            for (thread, start, end, name), kids in zip(ordered, children, strict=True)]
