"""The ML.ENERGY v2 and Wilkins loaders against the published files in data/, and broken copies.

Expected values are recomputed here from the raw CSV text with the csv module, independently
of the loaders' pandas code, so a wrong column mapping or a shifted line number shows up.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from support.paths import PUBLISHED_DATA

from vllm_piep.datasets.mlenergy import is_multimodal, load_mlenergy
from vllm_piep.datasets.model import BadRows, DatasetError, TreeDataset
from vllm_piep.datasets.wilkins import load_wilkins, load_wilkins_counted

DATA = PUBLISHED_DATA
MLE = DATA / "mlenergy-v2" / "a100_configs.csv"
STRUCT = DATA / "model_structures.csv"
WIL = DATA / "wilkins"


def records(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """Header and (start line, row) for every data record; a quoted field may span lines."""
    out = []
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        prev = reader.line_num
        for rec in reader:
            start, prev = prev + 1, reader.line_num
            if rec:
                out.append((start, dict(zip(header, rec))))
    return header, out


def write(path: Path, header: list[str], rows: list[dict[str, str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=header)
        w.writeheader()
        w.writerows(rows)
    return path


def node_at(ds: TreeDataset, path: Path, line: int) -> dict[str, object]:
    hit = ds.nodes[(ds.nodes.source == str(path)) & (ds.nodes.line == line)]
    assert len(hit) == 1, f"no single node from {path}:{line}"
    return hit.iloc[0].to_dict()


def issue_lines(ds: TreeDataset, path: Path) -> list[int]:
    return sorted(i.line for i in ds.issues if i.file == str(path))


# -- ML.ENERGY ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mle() -> TreeDataset:
    return load_mlenergy(MLE, STRUCT)


@pytest.fixture(scope="module")
def structures() -> dict[str, dict[str, str]]:
    return {r["model_id"]: r for _, r in records(STRUCT)[1]}


def comm_expected(s: dict[str, str], tp: int, pp: int) -> float:
    h, layers = int(s["hidden_size"]), int(s["num_hidden_layers"])
    tp_bytes = layers * 2 * 2 * (tp - 1) * h * 2   # 2 ring all-reduces per layer
    pp_bytes = (pp - 1) * h * 2                     # one hidden state per stage boundary
    return (tp_bytes + pp_bytes) / 2**20


def test_mlenergy_every_row_is_a_tree_or_an_issue(mle: TreeDataset) -> None:
    n_rows = len(records(MLE)[1])
    assert n_rows == len(mle.trees) + len(issue_lines(mle, MLE))
    assert mle.trees.tree_id.is_unique
    assert set(mle.nodes.level) == {"model"} and (mle.nodes.parent_id == "").all()


@pytest.mark.parametrize("which", ["tp", "pp"])
def test_mlenergy_features_match_the_raw_row(mle: TreeDataset, structures, which: str) -> None:
    rows = records(MLE)[1]
    if which == "tp":
        line, raw = next((n, r) for n, r in rows if int(r["TP"]) > 1 and int(r["PP"]) == 1)
    else:
        line, raw = next((n, r) for n, r in rows if int(r["PP"]) > 1)
    s = structures[raw["Model"]]
    tp, pp = int(raw["TP"]), int(raw["PP"])
    node = node_at(mle, MLE, line)
    assert node["energy_j"] == pytest.approx(float(raw["Energy/req (J)"]))
    expected = {
        "batch_size": float(raw["Avg BS (reqs)"]), "output_tokens": float(raw["Avg Output Tokens"]),
        "time_per_token_s": float(raw["Avg TPOT (s)"]),
        "tokens_per_s": float(raw["Token tput (tok/s)"]), "n_devices": tp * pp, "tp": tp,
        "pp": pp, "dp": 1, "layers": int(s["num_hidden_layers"]),
        "hidden_size": int(s["hidden_size"]), "ffn_size": int(s["intermediate_size"]),
        "heads": int(s["num_attention_heads"]), "kv_heads": int(s["num_key_value_heads"]),
        "head_dim": int(s["head_dim"]), "vocab_size": int(s["vocab_size"]),
        "params_b": float(s["total_params_b"]), "active_params_b": float(s["active_params_b"]),
        "comm_mib_per_token": comm_expected(s, tp, pp),
    }
    assert {k: node[k] for k in expected} == pytest.approx(expected)
    assert node["comm_mib_per_token"] > 0
    tree = mle.trees[mle.trees.tree_id == node["tree_id"]].iloc[0]
    assert node["tree_id"] == (f"mlenergy/{raw['Model']}/{raw['task']}/tp{tp}-pp{pp}"
                               f"-bs{raw['Max BS (reqs)']}")
    assert (tree.model, tree.group, tree.hardware) == (raw["Model"], raw["task"], raw["GPU"])
    assert (tree.batch_size, tree.tp, tree.pp, tree.dp) == (
        float(raw["Max BS (reqs)"]), tp, pp, 1)


def test_mlenergy_no_communication_on_one_device(mle: TreeDataset) -> None:
    single = (mle.nodes.tp == 1) & (mle.nodes.pp == 1)
    assert single.any() and (mle.nodes.comm_mib_per_token[single] == 0).all()
    assert (mle.nodes.comm_mib_per_token[~single] > 0).all()


def test_mlenergy_multimodal_rows_are_identifiable(mle: TreeDataset) -> None:
    raw_mm = sum(r["task"].startswith("mllm_") for _, r in records(MLE)[1])
    mm = is_multimodal(mle.trees)
    assert raw_mm > 0 and int(mm.sum()) == raw_mm
    assert mle.trees.group[mm].str.startswith("mllm_").all()
    assert not mle.trees.group[~mm].str.startswith("mllm_").any()


def test_mlenergy_missing_column_names_file_and_column(tmp_path: Path) -> None:
    header, rows = records(MLE)
    drop = "Avg TPOT (s)"
    bad = write(tmp_path / "no_tpot.csv", [c for c in header if c != drop],
                [{k: v for k, v in r.items() if k != drop} for _, r in rows[:5]])
    with pytest.raises(DatasetError, match=r"no_tpot\.csv.*Avg TPOT \(s\)"):
        load_mlenergy(bad, STRUCT)


def test_mlenergy_bad_rows_are_reported_with_their_lines(tmp_path: Path) -> None:
    header, rows = records(MLE)
    raw = [dict(r) for _, r in rows[:10]]
    raw[2]["Energy/req (J)"] = "0"             # line 4
    raw[6]["Model"] = "nobody/not-a-real-model"  # line 8
    path = write(tmp_path / "corrupt.csv", header, raw)
    ds = load_mlenergy(path, STRUCT, BadRows.SKIP)
    assert issue_lines(ds, path) == [4, 8]
    reasons = {i.line: i.reason for i in ds.issues}
    assert "not positive" in reasons[4] and "structure table" in reasons[8]
    assert len(ds.trees) == 8
    with pytest.raises(DatasetError, match=r"corrupt\.csv:4:.*\n.*corrupt\.csv:8:"):
        load_mlenergy(path, STRUCT, BadRows.REJECT)


def test_mlenergy_colliding_deployment_is_a_duplicate(tmp_path: Path) -> None:
    header, rows = records(MLE)
    raw = [dict(r) for _, r in rows[:3]] + [dict(rows[0][1])]
    path = write(tmp_path / "dup.csv", header, raw)
    ds = load_mlenergy(path, STRUCT)
    assert [(i.line, i.reason.startswith("duplicate of line 2")) for i in ds.issues] == [(5, True)]


# -- Wilkins --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wilkins():
    return load_wilkins_counted(WIL)


def test_wilkins_every_row_is_accounted_for(wilkins) -> None:
    ds, counts = wilkins
    files = sorted(p.name for p in WIL.glob("*.csv"))
    assert sorted(counts.files) == files
    for name in files:
        path, c = WIL / name, counts.files[name]
        rows = records(path)[1]
        startup = sum(r["Phase"] in ("tokenizer", "model load", "load model") for _, r in rows)
        assert c.rows == len(rows) == c.trees + c.issues + c.startup + c.elsewhere, name
        assert c.startup == startup, name
        assert c.trees == int((ds.nodes.source == str(path)).sum()), name
        assert c.trees == int((ds.trees.group == path.stem).sum()), name
        assert c.issues == len(issue_lines(ds, path)), name
    assert ds.trees.tree_id.is_unique


def test_wilkins_all_stats_is_the_union_and_loaded_once(wilkins) -> None:
    ds, counts = wilkins
    c = counts.files["all-stats.csv"]
    assert c.trees == 0 and c.elsewhere + c.startup == c.rows
    # no measurement twice: (system, model, GPUs, phase, runtime, GPU energy) is unique
    key = ds.with_tree_columns(["hardware", "model"])[
        ["hardware", "model", "n_devices", "time_s", "device_energy_j"]]
    assert not key.duplicated().any()


@pytest.mark.parametrize("case", ["dense", "moe"])
def test_wilkins_features_match_the_raw_row(wilkins, case: str) -> None:
    ds, _ = wilkins
    if case == "dense":
        path = WIL / "all-output-stats.csv"
        line, raw = next((n, r) for n, r in records(path)[1]
                         if r["Phase"].startswith("start-inference") and r["Iteration"] == "2")
        total = active = float(raw["Model"].split("(")[1].rstrip("B)"))
    else:
        path = WIL / "all-input-scale-stats.csv"
        line, raw = next((n, r) for n, r in records(path)[1] if r["Model"] == "Mixtral (8x7B)"
                         and "inference" in r["Phase"] and int(r["Number of GPUs"]) > 1)
        total, active = 46.7, 12.9
    node = node_at(ds, path, line)
    expected = {
        "energy_j": float(raw["CPU Energy (J)"]) + float(raw["GPU Energy (J)"]),
        "device_energy_j": float(raw["GPU Energy (J)"]), "time_s": float(raw["Runtime (s)"]),
        "input_tokens": float(raw["Number of Input Tokens"]),
        "output_tokens": float(raw["Number of Output Tokens"]),
        "batch_size": float(raw["Batch Size"]), "n_devices": float(raw["Number of GPUs"]),
        "params_b": total, "active_params_b": active,
    }
    assert {k: node[k] for k in expected} == pytest.approx(expected)
    tree = ds.trees[ds.trees.tree_id == node["tree_id"]].iloc[0]
    assert (tree.model, tree.hardware, tree.group) == (raw["Model"], raw["System"], path.stem)


def test_wilkins_negative_cpu_energy_is_a_bad_row(wilkins) -> None:
    ds, _ = wilkins
    path = WIL / "all-input-stats.csv"
    negative = [n for n, r in records(path)[1]
                if "inference" in r["Phase"] and float(r["CPU Energy (J)"]) < 0]
    assert issue_lines(ds, path) == negative


def test_wilkins_corrupted_copies(tmp_path: Path) -> None:
    src = WIL / "all-input-scale-stats.csv"
    header, rows = records(src)
    raw = [dict(r) for _, r in rows[:12]]
    first_inf = next(i for i, r in enumerate(raw) if "inference" in r["Phase"])
    raw[first_inf + 1]["GPU Energy (J)"] = "0"
    raw.append(dict(raw[first_inf]))             # an exact duplicate, appended last
    path = write(tmp_path / "copy.csv", header, raw)
    lines = [n for n, _ in records(path)[1]]
    ds, counts = load_wilkins_counted(tmp_path)
    assert issue_lines(ds, path) == [lines[first_inf + 1], lines[-1]]
    dup = next(i for i in ds.issues if i.line == lines[-1])
    assert dup.reason == f"duplicate of line {lines[first_inf]}"
    c = counts.files["copy.csv"]
    assert c.rows == len(raw) == c.trees + c.issues + c.startup + c.elsewhere
    with pytest.raises(DatasetError, match="copy.csv"):
        load_wilkins(tmp_path, BadRows.REJECT)

    gone = tmp_path / "gone"
    gone.mkdir()
    write(gone / "x.csv", [c for c in header if c != "GPU Energy (J)"],
          [{k: v for k, v in r.items() if k != "GPU Energy (J)"} for r in raw])
    with pytest.raises(DatasetError, match=r"x\.csv.*GPU Energy \(J\)"):
        load_wilkins(gone)


def test_mlenergy_communication_volume_by_hand(mle: TreeDataset) -> None:
    """Two rows worked out on paper from their configs (not from the loader's formula):
    Llama-3.1-70B at TP 8: 80 layers x 2 all-reduces x 2(8-1) ring sends x 8192 x 2 B
    = 36 700 160 B = 35 MiB per token; Mixtral-8x22B at TP 8, PP 2: 56 x 2 x 14 x 6144 x 2 B
    plus one 6144 x 2 B send across the stage boundary = 19 279 872 B = 18.3866 MiB."""
    nodes = mle.with_tree_columns(["model"])
    llama = nodes[(nodes.model == "meta-llama/Meta-Llama-3.1-70B-Instruct") & (nodes.tp == 8)]
    mixtral = nodes[(nodes.model == "mistralai/Mixtral-8x22B-Instruct-v0.1")
                    & (nodes.tp == 8) & (nodes.pp == 2)]
    assert len(llama) and len(mixtral)
    assert llama.comm_mib_per_token.to_numpy() == pytest.approx(35.0)
    assert mixtral.comm_mib_per_token.to_numpy() == pytest.approx(19_279_872 / 2**20)
