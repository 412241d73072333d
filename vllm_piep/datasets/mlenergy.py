"""ML.ENERGY leaderboard tables (v2: `mlenergy-v2/a100_configs.csv`, v3:
`mlenergy-v3/h100_configs.csv`) as a `TreeDataset`.

Each CSV row is one vLLM deployment (model x task x TP x PP x configured batch) on A100-40GB
with its GPU energy per request (NVML, `Energy/req (J)`). The leaderboard has no finer levels,
so each row becomes a single-node tree: the model root carries the energy, the serving
measurements (achieved batch, output tokens, TPOT, throughput) and the model's architecture,
joined on `Model` from `model_structures.csv` (`model_id`), so that a model-level predictor can
learn across models from structure rather than from names.

Tasks whose name starts with `mllm_` serve multimodal models (image + text prompts); their
structure row describes only the language backbone, so they stay identifiable through the
tree's `group` (the task) and `is_multimodal`.

ML.ENERGY leaderboard v3 (`mlenergy-v3/h100_configs.csv`, H100 80GB) has other column names
and more parallel layouts; `table_version` tells the two apart by their columns and
`_v3_as_v2` renames v3 into v2's columns, so one loader reads both:

    v3 column                          v2 column / meaning here
    model_id, task, gpu_model          Model, task, GPU
    tensor_parallel                    TP (PP is 1: v3 has no pipeline parallelism)
    energy_per_request_joules          Energy/req (J)
    max_num_seqs                       Max BS (reqs) (the configured batch)
    avg_batch_size, avg_output_len     Avg BS (reqs), Avg Output Tokens
    output_throughput_tokens_per_sec   Token tput (tok/s)
    avg_batch_size / throughput        Avg TPOT (s) (the mean time per output token of a
                                       request; v3 publishes only ITL percentiles)
    data_parallel, num_gpus            dp, n_devices

A v3 deployment with expert parallelism and `tensor_parallel` 1 runs one engine over all its
GPUs (see `vllm_piep.calibrate.published`), so its TP here is `num_gpus / data_parallel`. v3's
multimodal tasks are `image-chat` and `video-chat`. The two versions measure differently (see
the v3 README), so a dataset holds one version: never pool them without telling them apart.
"""

from __future__ import annotations

import csv as csvlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from vllm_piep.datasets.model import (
    NODE_COLUMNS,
    TREE_COLUMNS,
    BadRows,
    DatasetError,
    IssueLog,
    Level,
    TreeDataset,
    read_csv_table,
)

Row = dict[str, str]        # one CSV record, stripped strings (plus its int `line`)
Values = dict[str, float]   # the numeric columns of a record, NaN where not a number

MIB = float(2**20)
FP16_BYTES = 2
MULTIMODAL_PREFIX = "mllm_"
MULTIMODAL_TASKS = frozenset({"image-chat", "video-chat"})  # v3's

# CSV column -> canonical feature (vllm_piep.datasets.features).
EXECUTION_COLUMNS: dict[str, str] = {
    "Avg BS (reqs)": "batch_size",          # the achieved batch; the configured one is on the tree
    "Avg Output Tokens": "output_tokens",
    "Avg TPOT (s)": "time_per_token_s",
    "Token tput (tok/s)": "tokens_per_s",
}
# model_structures.csv column -> canonical feature.
STRUCTURE_COLUMNS: dict[str, str] = {
    "num_hidden_layers": "layers", "hidden_size": "hidden_size",
    "intermediate_size": "ffn_size",  # per-expert width for MoE models (see the README)
    "num_attention_heads": "heads", "num_key_value_heads": "kv_heads", "head_dim": "head_dim",
    "vocab_size": "vocab_size", "total_params_b": "params_b", "active_params_b": "active_params_b",
}
ENERGY_COLUMN = "Energy/req (J)"
REQUIRED: tuple[str, ...] = ("task", "Model", "GPU", "TP", "PP", ENERGY_COLUMN,
                             "Max BS (reqs)", *EXECUTION_COLUMNS)
V3_REQUIRED: tuple[str, ...] = ("model_id", "task", "gpu_model", "tensor_parallel",
                                "expert_parallel", "data_parallel", "num_gpus",
                                "energy_per_request_joules", "max_num_seqs", "avg_batch_size",
                                "avg_output_len", "output_throughput_tokens_per_sec")
V3_MARKER = "energy_per_request_joules"  # a column only v3 has
LAYOUT_COLUMNS = ("DP", "GPUs")  # added to v2 rows (1, TP x PP) and filled from v3's
STRUCTURE_REQUIRED: tuple[str, ...] = ("model_id", *STRUCTURE_COLUMNS)
FEATURES: tuple[str, ...] = (*EXECUTION_COLUMNS.values(), "n_devices", "tp", "pp", "dp",
                             *STRUCTURE_COLUMNS.values(), "comm_mib_per_token", "time_s",
                             "device_s", "active_params_per_device_b", "logits_share",
                             "kv_share")


def csv_record_lines(path: Path) -> list[int]:
    """The 1-based file line on which each data record starts (header = line 1).

    A quoted field may hold newlines, so the record index + 2 is not the line number; the
    csv module's `line_num` counts physical lines. Blank lines are skipped, as pandas does.
    """
    starts: list[int] = []
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csvlib.reader(fh)
        prev = 0
        for i, record in enumerate(reader):
            start = prev + 1
            prev = reader.line_num
            if i > 0 and record:
                starts.append(start)
    return starts


def read_csv_lines(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    """The CSV as strings with a `line` column; a file lacking required columns is refused."""
    raw = read_csv_table(path, dtype=str, keep_default_na=False)
    raw.columns = [c.strip().lstrip("\ufeff") for c in raw.columns]
    missing = [c for c in required if c not in raw.columns]
    if missing:
        raise DatasetError(f"{path}:1: missing columns {missing}")
    lines = csv_record_lines(path)
    if len(lines) != len(raw):
        raise DatasetError(f"{path}: {len(raw)} records but {len(lines)} record starts; "
                           "malformed quoting?")
    raw = raw.fillna("").apply(lambda s: s.str.strip())
    raw.insert(0, "line", lines)
    return raw


def comm_mib_per_token(hidden_size: float | np.ndarray, layers: float | np.ndarray,
                       tp: float | np.ndarray, pp: float | np.ndarray) -> float | np.ndarray:
    """Collective payload per generated token, summed over all devices, in MiB (2**20 bytes).

    What the PIE-P model tree knows about a Megatron-style deployment:

    * tensor parallel: 2 all-reduces per layer (after attention and after the MLP), each of
      `hidden_size` fp16 values per token; a ring all-reduce moves 2*(tp-1)/tp of the payload
      per device, so 2*(tp-1) payloads over the tp devices. Each pipeline stage runs its own
      layers/pp layers on its tp devices, so the total over all tp*pp devices does not depend
      on pp: ``layers * 2 * 2*(tp-1) * hidden_size * 2 bytes``;
    * pipeline parallel: the stage output, `hidden_size` fp16 values per token, crosses each of
      the (pp-1) stage boundaries: ``(pp-1) * hidden_size * 2 bytes``.

    comm = [layers * 4 * (tp-1) + (pp-1)] * hidden_size * 2 / 2**20; 0 for tp = pp = 1.
    """
    payload = np.multiply(hidden_size, FP16_BYTES)
    tp_bytes = np.multiply(layers, 2 * 2) * np.subtract(tp, 1) * payload
    pp_bytes = np.subtract(pp, 1) * payload
    return (tp_bytes + pp_bytes) / MIB


def is_multimodal(trees: pd.DataFrame) -> pd.Series:
    """True for the trees of a multimodal task (`mllm_*`), whose prompts carry images and whose
    structure features describe only the language backbone."""
    group = trees["group"].astype(str)
    return group.str.startswith(MULTIMODAL_PREFIX) | group.isin(MULTIMODAL_TASKS)


def table_version(columns: Sequence[str], path: Path) -> str:
    """'v3' or 'v2' by the columns a leaderboard export has; a DatasetError naming the missing
    columns of the version it looks like."""
    version, required = (("v3", V3_REQUIRED) if V3_MARKER in columns else ("v2", REQUIRED))
    missing = [c for c in required if c not in columns]
    if missing:
        raise DatasetError(f"{path}:1: missing columns {missing} for an ML.ENERGY {version} "
                           f"table (v2: {REQUIRED[0]}, {REQUIRED[1]}, ...; v3: "
                           f"{V3_REQUIRED[0]}, {V3_REQUIRED[1]}, ...)")
    return version


def mlenergy_version(csv: str | Path) -> str:
    """The leaderboard version ('v2' or 'v3') of a table, from its header alone."""
    path = Path(csv)
    return table_version(list(read_csv_table(path, nrows=1, dtype=str).columns), path)


def _v3_as_v2(raw: pd.DataFrame) -> pd.DataFrame:
    """v3 rows in v2's columns (module docstring), strings as `read_csv_lines` gives them."""
    num = {c: pd.to_numeric(raw[c], errors="coerce") for c in
           ("tensor_parallel", "expert_parallel", "data_parallel", "num_gpus",
            "avg_batch_size", "output_throughput_tokens_per_sec")}
    one_engine = (num["expert_parallel"] > 1) & (num["tensor_parallel"] == 1)
    tp = num["tensor_parallel"].where(~one_engine, num["num_gpus"] / num["data_parallel"])
    tpot = num["avg_batch_size"] / num["output_throughput_tokens_per_sec"]

    def text(values: pd.Series) -> pd.Series:
        # NaN (a bad cell) stays empty, so the row is reported as non-numeric
        return values.map(lambda v: "" if pd.isna(v) else repr(float(v)))
    return pd.DataFrame({
        "line": raw["line"], "task": raw["task"], "Model": raw["model_id"],
        "GPU": raw["gpu_model"], "TP": text(tp), "PP": "1",
        ENERGY_COLUMN: raw["energy_per_request_joules"], "Max BS (reqs)": raw["max_num_seqs"],
        "Avg BS (reqs)": raw["avg_batch_size"], "Avg Output Tokens": raw["avg_output_len"],
        "Avg TPOT (s)": text(tpot),
        "Token tput (tok/s)": raw["output_throughput_tokens_per_sec"],
        "DP": raw["data_parallel"], "GPUs": raw["num_gpus"]})


def load_mlenergy(csv: str | Path, structures: str | Path,
                  policy: BadRows = BadRows.SKIP) -> TreeDataset:
    """One single-node tree per leaderboard row, with structure features joined on the model.

    Bad rows (non-numeric or missing values, non-positive energy, a model absent from the
    structure table, a second row for the same deployment) go to the `IssueLog` with their line.
    """
    path, struct_path = Path(csv), Path(structures)
    log = IssueLog(policy)
    rows = read_csv_lines(path, ())
    if table_version(list(rows.columns), path) == "v3":
        rows = _v3_as_v2(rows)
    else:
        tp, pp = (pd.to_numeric(rows[c], errors="coerce") for c in ("TP", "PP"))
        rows = rows.assign(DP="1", GPUs=(tp * pp).map(lambda v: "" if pd.isna(v) else str(v)))
    table = _structure_table(struct_path)
    nodes, trees = _build(rows, table, path, log)
    issues = log.close()
    return TreeDataset.from_frames("mlenergy", nodes, trees, FEATURES, issues)


def _structure_table(path: Path) -> pd.DataFrame:
    """model_id -> canonical structure features (numeric; a bad cell is NaN and makes every row
    of that model a bad row)."""
    raw = read_csv_lines(path, STRUCTURE_REQUIRED)
    table = pd.DataFrame({new: pd.to_numeric(raw[old], errors="coerce")
                          for old, new in STRUCTURE_COLUMNS.items()})
    table.index = raw["model_id"]
    return table[~table.index.duplicated()]


def _numeric(rows: pd.DataFrame) -> pd.DataFrame:
    cols = ["TP", "PP", ENERGY_COLUMN, "Max BS (reqs)", *EXECUTION_COLUMNS, *LAYOUT_COLUMNS]
    return pd.DataFrame({c: pd.to_numeric(rows[c], errors="coerce") for c in cols})


def _row_problem(row: Row, num: Values, structs: dict[str, Values]) -> str | None:
    """Why a row cannot become a tree, or None."""
    empty = [c for c in ("task", "Model", "GPU") if not row[c]]
    if empty:
        return f"missing values {empty}"
    bad = [c for c, v in num.items() if not np.isfinite(v)]
    if bad:
        return f"missing or non-numeric {bad}"
    if num[ENERGY_COLUMN] <= 0:
        return f"{ENERGY_COLUMN} {num[ENERGY_COLUMN]:g} is not positive"
    if min(num["TP"], num["PP"], num["Max BS (reqs)"], num["DP"], num["GPUs"]) < 1:
        return "TP, PP, DP, GPUs and Max BS must be >= 1"
    if min(num["Token tput (tok/s)"], num["Avg Output Tokens"]) <= 0:
        return "throughput and output tokens must be positive"
    if row["Model"] not in structs:
        return f"model {row['Model']!r} is not in the structure table (cannot join)"
    if not np.isfinite(list(structs[row["Model"]].values())).all():
        return f"model {row['Model']!r} has missing structure values"
    return None


def _tree_id(row: Row, num: Values) -> str:
    dp = f"-dp{int(num['DP'])}" if num["DP"] != 1 else ""
    return (f"mlenergy/{row['Model']}/{row['task']}/tp{int(num['TP'])}-pp{int(num['PP'])}{dp}"
            f"-bs{int(num['Max BS (reqs)'])}")


def _build(rows: pd.DataFrame, table: pd.DataFrame, path: Path,
           log: IssueLog) -> tuple[pd.DataFrame, pd.DataFrame]:
    num = _numeric(rows)
    seen: dict[str, int] = {}
    node_rows, tree_rows = [], []
    structs = table.to_dict("index")
    for row, values in zip(rows.to_dict("records"), num.to_dict("records")):
        problem = _row_problem(row, values, structs)
        if problem is None:
            tree_id = _tree_id(row, values)
            if tree_id in seen:
                problem = f"duplicate of line {seen[tree_id]} (same deployment {tree_id})"
        if problem is not None:
            log.report(path, int(row["line"]), problem)
            continue
        seen[tree_id] = int(row["line"])
        node_rows.append(_node(row, values, structs[row["Model"]], tree_id, path))
        tree_rows.append(_tree(row, values, tree_id))
    nodes = pd.DataFrame(node_rows, columns=[*NODE_COLUMNS, *FEATURES])
    trees = pd.DataFrame(tree_rows, columns=list(TREE_COLUMNS))
    return nodes, trees




def _node(row: Row, num: Values, struct: Values, tree_id: str,
          path: Path) -> dict[str, object]:
    tp, pp = float(num["TP"]), float(num["PP"])
    node: dict[str, object] = {
        "tree_id": tree_id, "node_id": "model", "parent_id": "", "level": str(Level.MODEL),
        "type": "model", "scope": "", "component": "model",
        "energy_j": float(num[ENERGY_COLUMN]), "source": str(path), "line": int(row["line"]),
    }
    node.update({new: float(num[old]) for old, new in EXECUTION_COLUMNS.items()})
    node.update({"n_devices": float(num["GPUs"]), "tp": tp, "pp": pp, "dp": float(num["DP"])})
    node.update({k: float(v) for k, v in struct.items()})
    node["comm_mib_per_token"] = float(comm_mib_per_token(
        struct["hidden_size"], struct["layers"], tp, pp))
    node.update(derived_features(node))
    return node


def derived_features(node: dict[str, object]) -> dict[str, float]:
    """Physical quantities the predictor works in: the deployment's seconds per request
    (output tokens / throughput: requests run concurrently, so this is the request's share of
    wall time), device-seconds per request, active parameters per device, and the shares of the
    model's work the PIE-P tree puts in the logits (LM head) and in the KV projections (GQA)."""
    f = {k: float(v) for k, v in node.items() if isinstance(v, (int, float))}
    time_s = f["output_tokens"] / f["tokens_per_s"]
    return {
        "time_s": time_s,
        "device_s": time_s * f["n_devices"],
        "active_params_per_device_b": f["active_params_b"] / f["n_devices"],
        "logits_share": f["vocab_size"] * f["hidden_size"] / 1e9 / f["active_params_b"],
        "kv_share": f["kv_heads"] * f["head_dim"] / f["hidden_size"],
    }


def _tree(row: Row, num: Values, tree_id: str) -> dict[str, object]:
    return {"tree_id": tree_id, "dataset": "mlenergy", "model": row["Model"],
            "group": row["task"], "hardware": row["GPU"],
            "batch_size": float(num["Max BS (reqs)"]), "seq_len": np.nan,
            "tp": float(num["TP"]), "pp": float(num["PP"]), "dp": float(num["DP"])}
