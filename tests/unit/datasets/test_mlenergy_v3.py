"""ML.ENERGY leaderboard v3 (H100) read by the same loader as v2, told apart by its columns,
on the published tables in data/."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.support.paths import PUBLISHED_DATA
from vllm_piep.calibrate.__main__ import main
from vllm_piep.datasets.mlenergy import is_multimodal, load_mlenergy, mlenergy_version
from vllm_piep.datasets.model import DatasetError

V2 = PUBLISHED_DATA / "mlenergy-v2" / "a100_configs.csv"
V3 = PUBLISHED_DATA / "mlenergy-v3" / "h100_configs.csv"
STRUCTURES = PUBLISHED_DATA / "model_structures.csv"


@pytest.fixture(scope="module")
def v3():  # type: ignore[no-untyped-def]
    return load_mlenergy(V3, STRUCTURES)


def test_the_version_comes_from_the_columns(tmp_path: Path) -> None:
    assert mlenergy_version(V2) == "v2" and mlenergy_version(V3) == "v3"
    half = tmp_path / "half.csv"
    pd.read_csv(V3).head(3).drop(columns=["max_num_seqs"]).to_csv(half, index=False)
    with pytest.raises(DatasetError, match=r"half\.csv:1: missing columns \['max_num_seqs'\] "
                                           r"for an ML.ENERGY v3 table"):
        load_mlenergy(half, STRUCTURES)


def test_every_v3_row_is_a_tree_or_a_reported_issue(v3) -> None:  # type: ignore[no-untyped-def]
    raw = pd.read_csv(V3)
    assert len(v3.trees) + len(v3.issues) == len(raw)
    # the only rows left out are repeated measurements of one deployment, each said
    assert all(i.reason.startswith("duplicate of line") for i in v3.issues)


def test_v3_values_land_in_the_v2_features(v3) -> None:  # type: ignore[no-untyped-def]
    raw = pd.read_csv(V3)
    raw.index = raw.index + 2  # file lines (header = line 1)
    nodes = v3.nodes.set_index("line")
    row = raw.loc[nodes.index]
    assert np.allclose(nodes.energy_j, row.energy_per_request_joules)
    assert np.allclose(nodes.n_devices, row.num_gpus)
    assert np.allclose(nodes.dp, row.data_parallel)
    assert np.allclose(nodes.time_per_token_s,
                       row.avg_batch_size / row.output_throughput_tokens_per_sec)
    assert np.allclose(nodes.output_tokens, row.avg_output_len)
    # expert-parallel deployments run one engine over their GPUs: TP x DP covers them all
    assert np.allclose(nodes.tp * nodes.pp * nodes.dp, nodes.n_devices)


def test_v3_multimodal_tasks_are_told_apart(v3) -> None:  # type: ignore[no-untyped-def]
    mm = is_multimodal(v3.trees)
    assert set(v3.trees.group[mm]) == {"image-chat", "video-chat"}
    assert not mm[v3.trees.group == "lm-arena-chat"].any()


@pytest.mark.slow
def test_evaluate_and_validate_prior_read_v3(tmp_path: Path) -> None:
    out = tmp_path / "v3.json"
    assert main(["evaluate", "--dataset", "mlenergy", "--data", str(V3), "--structures",
                 str(STRUCTURES), "--json", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert "v3" in result["ground_truth"] and "H100" in result["ground_truth"]
    assert "targets" not in result  # the targets were set on v2
    assert result["multimodal"]["levels"]["model"]["n"] > 0
    text_models = {m for m, g in zip(pd.read_csv(V3).model_id, pd.read_csv(V3).task)
                   if g not in ("image-chat", "video-chat")}
    assert set(result["per_model"]) <= text_models
    assert main(["validate-prior", "--data", str(V3), "--structures", str(STRUCTURES),
                 "--out", str(tmp_path / "prior"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "prior" / "summary.json").read_text())
    assert summary["coverage"]["priced"] > 0
    assert "H100" in " ".join(str(r.get("gpu")) for r in summary["by_gpu_architecture"])
