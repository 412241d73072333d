"""Wilkins et al.'s PyTorch/Hugging Face inference measurements (`wilkins/*.csv`).

Each row is one phase of one run: `tokenizer`, `model load` / `load model` (start-up, not
inference, so not loaded), or `[start-]inference-<X>-<iteration>` (one `pipe(prompt)` call,
Algorithm 1 step 4, with batch `Batch Size`, an input of `Number of Input Tokens` and up to
`Number of Output Tokens` new tokens; the all-input files name that column
`Output Token Limit`). Each inference row becomes a single-node tree whose root energy is
`CPU Energy (J) + GPU Energy (J)`, the whole measured cost of the call.

Which energy the paper measures: the HotCarbon'24 paper ("Exploring the Energy Usage of PyTorch
LLM Inference", Sec. 3.3, Table 1) treats the GPU energy as *the* measurement on the NVIDIA
systems (PyJoules over nvidia-smi; it says the AMD CPUs gave no energy readings) and reports
GPU and CPU energy (powermetrics, CPU scaled by the process' impact factor) on the M1 Pro. The
released files also carry Falcon and Mixtral and Palmetto Intel systems, i.e. later runs
with a CPU column on every system (RAPL on Intel). We keep GPU energy as `device_energy_j` so a
GPU-only target stays available, and use CPU + GPU as `energy_j`, the whole measured cost. A
negative CPU energy (seen on Palmetto Intel+V100, likely a RAPL counter wrap) is a bad row.

The same measurement appears in several files: `all-stats.csv` is exactly the union of
`all-input-stats.csv` and `all-output-stats.csv`, and the single-GPU Swing rows of the two
`*-scale-stats.csv` files repeat rows of those two. A measurement is identified by
`MEASUREMENT_KEY` (system, model, GPUs, batch, phase, iteration, input tokens, runtime and both
energies; runtime and energies are recorded to ~15 digits, so unrelated runs do not collide).
Files are read in `FILE_ORDER` (the sweep files, then the scale files, then `all-stats.csv`,
then any other CSV by name) and a measurement is loaded from the first file that has it; its
tree's `group` is that file's stem. Later copies are counted in `WilkinsCounts.elsewhere`, not
reported as bad rows. Inside one file a repeated measurement is a bad row ("duplicate of line N").

Parallelism: Accelerate's `device_map="auto"` puts consecutive layers on successive GPUs (naive
model parallelism, no tensor split, no micro-batches), so trees carry tp = dp = 1, pp = GPUs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from vllm_piep.datasets.mlenergy import Row, Values, read_csv_lines
from vllm_piep.datasets.model import (
    NODE_COLUMNS,
    TREE_COLUMNS,
    BadRows,
    DatasetError,
    IssueLog,
    Level,
    TreeDataset,
)

FILE_ORDER: tuple[str, ...] = ("all-input-stats.csv", "all-output-stats.csv",
                               "all-input-scale-stats.csv", "all-output-scale-stats.csv",
                               "all-stats.csv")
OUTPUT_COLUMNS: tuple[str, ...] = ("Number of Output Tokens", "Output Token Limit")
REQUIRED: tuple[str, ...] = ("Phase", "Runtime (s)", "CPU Energy (J)", "GPU Energy (J)",
                             "Number of Input Tokens", "Iteration", "Model", "Number of GPUs",
                             "Batch Size", "System")
NUMERIC: tuple[str, ...] = ("Runtime (s)", "CPU Energy (J)", "GPU Energy (J)",
                            "Number of Input Tokens", "Iteration", "Number of GPUs",
                            "Batch Size", "output")
MEASUREMENT_KEY: tuple[str, ...] = ("System", "Model", "Number of GPUs", "Batch Size", "Phase",
                                    "Iteration", "Number of Input Tokens", "Runtime (s)",
                                    "CPU Energy (J)", "GPU Energy (J)")
STARTUP_PHASES = frozenset({"tokenizer", "model load", "load model"})
INFERENCE_PHASE = re.compile(r"^(start-)?inference-[^-]+-\d+$")
# Mixture-of-experts names: (total, active) parameters in 1e9. Mixtral-8x7B: 46.7B total,
# 12.9B active (Mistral AI's release); the "8x7B" of the name is not the total.
MOE_PARAMS_B: dict[str, tuple[float, float]] = {"Mixtral (8x7B)": (46.7, 12.9)}
DENSE_SIZE = re.compile(r"\((\d+(?:\.\d+)?)B\)\s*$")
FEATURES: tuple[str, ...] = ("input_tokens", "output_tokens", "batch_size", "n_devices",
                             "time_s", "device_energy_j", "params_b", "active_params_b")


@dataclass
class FileCount:
    """Where each data row of one file went: rows == trees + issues + startup + elsewhere."""

    rows: int = 0
    trees: int = 0       # inference measurements loaded from this file
    issues: int = 0      # bad rows reported to the IssueLog
    startup: int = 0     # tokenizer / model-load phases: not inference, not loaded
    elsewhere: int = 0   # the same measurement was already taken from an earlier file


@dataclass
class WilkinsCounts:
    files: dict[str, FileCount] = field(default_factory=dict)


def params_b(model: str) -> tuple[float, float] | None:
    """(total, active) parameters in 1e9 from a name like "Llama-2 (7B)"; MoE names come from
    `MOE_PARAMS_B`. None when the name says neither."""
    if model in MOE_PARAMS_B:
        return MOE_PARAMS_B[model]
    m = DENSE_SIZE.search(model)
    if m is None:
        return None
    size = float(m.group(1))
    return size, size


def load_wilkins(directory: str | Path, policy: BadRows = BadRows.SKIP) -> TreeDataset:
    """One single-node tree per distinct inference measurement in the directory's CSVs."""
    return load_wilkins_counted(directory, policy)[0]


def load_wilkins_counted(directory: str | Path, policy: BadRows = BadRows.SKIP
                         ) -> tuple[TreeDataset, WilkinsCounts]:
    """`load_wilkins` plus, per file, where every row went (see `FileCount`)."""
    root = Path(directory)
    paths = _ordered_files(root)
    if not paths:
        raise DatasetError(f"{root}: no CSV files")
    log = IssueLog(policy)
    counts = WilkinsCounts()
    seen: dict[tuple[str, ...], str] = {}
    nodes, trees = [], []
    for path in paths:
        count = counts.files.setdefault(path.name, FileCount())
        n, t = _load_file(path, log, seen, count)
        nodes += n
        trees += t
    issues = log.close()
    node_df = pd.DataFrame(nodes, columns=[*NODE_COLUMNS, *FEATURES])
    tree_df = pd.DataFrame(trees, columns=list(TREE_COLUMNS))
    _number_repeats(node_df, tree_df)
    ds = TreeDataset.from_frames("wilkins", node_df, tree_df, FEATURES, issues)
    return ds, counts


def _ordered_files(root: Path) -> list[Path]:
    found = {p.name: p for p in root.glob("*.csv") if p.is_file()}
    first = [found.pop(name) for name in FILE_ORDER if name in found]
    return first + [found[name] for name in sorted(found)]


def _read(path: Path) -> pd.DataFrame:
    rows = read_csv_lines(path, REQUIRED)
    have = [c for c in OUTPUT_COLUMNS if c in rows.columns]
    if not have:
        raise DatasetError(f"{path}:1: missing columns [{' or '.join(OUTPUT_COLUMNS)!r}]")
    rows["output"] = rows[have[0]]
    return rows


def _load_file(path: Path, log: IssueLog, seen: dict[tuple[str, ...], str],
               count: FileCount) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    rows = _read(path)
    count.rows = len(rows)
    num = pd.DataFrame({c: pd.to_numeric(rows[c], errors="coerce") for c in NUMERIC})
    in_file: dict[tuple[str, ...], int] = {}
    whole_rows: dict[tuple[str, ...], int] = {}
    nodes, trees = [], []
    data_cols = [c for c in rows.columns if c != "line"]
    for row, values in zip(rows.to_dict("records"), num.to_dict("records")):
        line = int(row["line"])
        key = tuple(row[c] for c in MEASUREMENT_KEY)
        whole = tuple(row[c] for c in data_cols)
        problem = _duplicate(whole, key, whole_rows, in_file)
        whole_rows.setdefault(whole, line)
        in_file.setdefault(key, line)
        if problem is None and row["Phase"] in STARTUP_PHASES:
            count.startup += 1
            continue
        if problem is None and key in seen:
            count.elsewhere += 1
            continue
        problem = problem or _row_problem(row, values)
        seen.setdefault(key, f"{path.name}:{line}")
        if problem is not None:
            log.report(path, line, problem)
            count.issues += 1
            continue
        node, tree = _tree(row, values, path)
        nodes.append(node)
        trees.append(tree)
        count.trees += 1
    return nodes, trees


def _duplicate(whole: tuple[str, ...], key: tuple[str, ...], whole_rows: dict[tuple[str, ...],
               int], in_file: dict[tuple[str, ...], int]) -> str | None:
    if whole in whole_rows:
        return f"duplicate of line {whole_rows[whole]}"
    if key in in_file:
        return f"same measurement as line {in_file[key]} (other columns differ)"
    return None


def _row_problem(row: Row, num: Values) -> str | None:
    """Why an inference row cannot become a tree, or None."""
    if not INFERENCE_PHASE.match(row["Phase"]):
        return f"unknown phase {row['Phase']!r}"
    empty = [c for c in ("Model", "System") if not row[c]]
    if empty:
        return f"missing values {empty}"
    bad = [c if c != "output" else "output tokens" for c, v in num.items()
           if not np.isfinite(v)]
    if bad:
        return f"missing or non-numeric {bad}"
    if num["GPU Energy (J)"] <= 0:
        return f"GPU Energy (J) {num['GPU Energy (J)']:g} is not positive"
    if num["CPU Energy (J)"] < 0:
        return f"CPU Energy (J) {num['CPU Energy (J)']:g} is negative (counter wrap?)"
    if num["Runtime (s)"] <= 0 or num["Number of GPUs"] < 1 or num["Batch Size"] < 1:
        return "Runtime, Number of GPUs and Batch Size must be positive"
    if params_b(row["Model"]) is None:
        return f"model {row['Model']!r}: no parameter count in the name or MOE_PARAMS_B"
    return None




def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_")


def _tree(row: Row, num: Values,
          path: Path) -> tuple[dict[str, object], dict[str, object]]:
    total, active = params_b(row["Model"]) or (np.nan, np.nan)
    gpus = float(num["Number of GPUs"])
    tree_id = (f"wilkins/{_slug(row['System'])}/{_slug(row['Model'])}/{int(gpus)}gpu/"
               f"{row['Phase']}")
    node: dict[str, object] = {
        "tree_id": tree_id, "node_id": "model", "parent_id": "", "level": str(Level.MODEL),
        "type": "model", "scope": "", "component": "model",
        "energy_j": float(num["CPU Energy (J)"] + num["GPU Energy (J)"]),
        "source": str(path), "line": int(row["line"]),
        "input_tokens": float(num["Number of Input Tokens"]),
        "output_tokens": float(num["output"]), "batch_size": float(num["Batch Size"]),
        "n_devices": gpus, "time_s": float(num["Runtime (s)"]),
        "device_energy_j": float(num["GPU Energy (J)"]), "params_b": total,
        "active_params_b": active,
    }
    tree: dict[str, object] = {
        "tree_id": tree_id, "dataset": "wilkins", "model": row["Model"], "group": path.stem,
        "hardware": row["System"], "batch_size": float(num["Batch Size"]), "seq_len": np.nan,
        "tp": 1.0, "pp": gpus, "dp": 1.0,  # device_map="auto": layers split over the GPUs
    }
    return node, tree


def _number_repeats(nodes: pd.DataFrame, trees: pd.DataFrame) -> None:
    """Repeated runs of one configuration (same system, model, GPUs, phase) are distinct
    measurements; the second and later get `#2`, `#3`... so tree ids stay unique."""
    k = trees.groupby("tree_id").cumcount()
    suffix = np.where(k > 0, "#" + (k + 1).astype(str), "")
    trees["tree_id"] = trees["tree_id"] + suffix
    nodes["tree_id"] = trees["tree_id"].to_numpy()
