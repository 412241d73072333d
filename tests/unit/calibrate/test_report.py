"""The evaluation report: every plot is written and is a PNG, the page names what it shows and
escapes what it is given."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from vllm_piep.calibrate.report import write_report

PNG = b"\x89PNG"
LEVELS = ("ml", "module", "model")


def _predictions(models: list[str], methods: list[str], levels: tuple[str, ...]) -> pd.DataFrame:
    """A few trees per model; each method gets its own multiplicative noise."""
    rng = np.random.default_rng(0)
    rows = []
    for model in models:
        for tree in range(4):
            for lv_i, level in enumerate(levels):
                n_nodes = 1 if level == "model" else 5 * (len(levels) - lv_i)
                measured = rng.uniform(1, 100, n_nodes) * 10.0 ** lv_i
                for k, method in enumerate(methods):
                    noise = 1 + rng.normal(0, 0.02 * (k + 1), n_nodes)
                    for node in range(n_nodes):
                        rows.append({
                            "tree_id": f"{model}-{tree}", "model": model, "level": level,
                            "node_id": node, "type": "Linear", "method": method,
                            "measured_j": measured[node],
                            "predicted_j": measured[node] * noise[node]})
    return pd.DataFrame(rows)


def _result(models: list[str]) -> dict:
    per_model = {m: {"ml": 0.5 + i, "module": 0.4 + i, "model": 0.3 + i}
                 for i, m in enumerate(models)}
    return {
        "dataset": "irene", "protocol": "leave-one-model-out", "n_trees": 12, "method": "piep",
        "levels": {"ml": {"mape": 0.52, "n": 300, "mape_nodes": 0.5},
                   "module": {"mape": 1.37, "n": 200, "mape_nodes": 1.2},
                   "model": {"mape": 2.41, "n": 12, "mape_nodes": 2.4}},
        "per_model": per_model,
        "baselines": {
            "direct": {"levels": {"ml": {"mape": 3.1, "n": 300},
                                  "model": {"mape": 5.25, "n": 12}},
                       "per_model": {models[0]: {"ml": 3.0, "model": 5.0}}},
            "gpu_only": {"levels": {"ml": {"mape": 0.31, "n": 300},
                                    "module": {"mape": 2.0, "n": 200},
                                    "model": {"mape": 9.0, "n": 12}},
                         "per_model": {m: {"model": 9.0} for m in models}},
        },
        "targets": {"model": 3.9, "module": 2.3, "ml": 0.7},
        "bad_rows": 3, "notes": ["two trees dropped: <bad> & odd"], "unknown_key": [1, 2],
    }


def _check_pngs(out: Path, page: str, names: list[str]) -> None:
    for name in names:
        assert (out / name).read_bytes()[:4] == PNG, name
        assert f'<a href="{name}"><img src="{name}"' in page  # linked to the full image
    assert "max-width: 100%" in page


def _captions(page: str) -> dict[str, str]:
    return dict(re.findall(r'<a href="([^"]+)"><img[^>]*></a><figcaption>([^<]*)</figcaption>',
                           page))


def _per_model_result(models: list[str], baseline: list[float]) -> dict:
    return {"dataset": "ml.energy", "protocol": "leave-one-model-out", "method": "piep",
            "levels": {"model": {"mape": 4.0, "n": 8}},
            "per_model": {m: {"model": 3.0 + i} for i, m in enumerate(models)},
            "baselines": {"wilkins": {"levels": {"model": {"mape": 900.0, "n": 8}},
                                      "per_model": {m: {"model": v}
                                                    for m, v in zip(models, baseline)}}}}


@pytest.mark.parametrize("baseline,log", [([1500.0, 900.0], True), ([5.0, 7.0], False)])
def test_values_that_span_decades_go_on_a_log_axis(tmp_path: Path, baseline: list[float],
                                                   log: bool) -> None:
    """A baseline at 1500 % (Wilkins et al. on H100) beside errors of a few percent: on a
    linear axis every other bar would sit on the floor."""
    models = ["llama-3-8b", "mistral-7b"]
    preds = _predictions(models, ["piep", "wilkins"], ("model",))
    if log:
        preds.loc[preds["method"] == "wilkins", "predicted_j"] *= 15
    page = write_report(_per_model_result(models, baseline), preds,
                        tmp_path).read_text(encoding="utf-8")
    captions = _captions(page)
    assert ("log scale" in captions["per_model.png"]) is log
    assert ("log scale" in captions["error_cdf.png"]) is log


def test_error_by_node_type(tmp_path: Path) -> None:
    """The predictions carry each node's type: the report shows which types the error is in,
    and leaves the plot out when there are none."""
    models = ["bert-base-uncased", "gpt2"]
    preds = _predictions(models, ["piep", "direct"], LEVELS)
    preds["type"] = np.where(preds["node_id"] % 2 == 0, "Linear", "LayerNorm")
    preds.loc[(preds["type"] == "LayerNorm") & (preds["method"] == "piep"), "predicted_j"] *= 3
    page = write_report(_result(models), preds, tmp_path / "a").read_text(encoding="utf-8")
    assert "per_type.png" in _captions(page)
    assert (tmp_path / "a" / "per_type.png").read_bytes()[:4] == PNG
    page = write_report(_result(models), preds.drop(columns="type"),
                        tmp_path / "b").read_text(encoding="utf-8")
    assert "per_type.png" not in page and not (tmp_path / "b" / "per_type.png").exists()


def test_full_report(tmp_path: Path) -> None:
    models = ["bert-base-uncased", "gpt2", "roberta-base"]
    result = _result(models)
    preds = _predictions(models, ["piep", "direct", "gpu_only"], LEVELS)
    index = write_report(result, preds, tmp_path / "report")
    assert index == tmp_path / "report" / "index.html"
    page = index.read_text(encoding="utf-8")
    _check_pngs(index.parent, page,
                [f"scatter_{lv}.png" for lv in LEVELS]
                + ["residuals.png", "error_cdf.png", "per_model.png", "per_type.png"])
    for model in models:
        assert model in page
    for value in ("0.52", "1.37", "2.41", "3.90"):
        assert value in page
    # best per column: gpu_only wins ml, piep wins module and model
    assert "<b>0.31</b>" in page and "<b>1.37</b>" in page and "<b>2.41</b>" in page
    assert "<b>0.52</b>" not in page
    assert "–" in page  # direct has no module level
    assert "&lt;bad&gt; &amp; odd" in page
    assert not list(index.parent.glob(".*tmp"))


def test_model_level_only(tmp_path: Path) -> None:
    """ML.ENERGY data has only whole-model measurements."""
    models = ["llama-3-8b", "mistral-7b"]
    result = {"dataset": "ml.energy", "protocol": "leave-one-model-out", "method": "piep",
              "levels": {"model": {"mape": 4.56, "n": 8}},
              "per_model": {m: {"model": 4.0 + i} for i, m in enumerate(models)},
              "baselines": {"direct": {"levels": {"model": {"mape": 7.0, "n": 8}},
                                       "per_model": {}}}}
    preds = _predictions(models, ["piep", "direct"], ("model",))
    page = write_report(result, preds, tmp_path).read_text(encoding="utf-8")
    _check_pngs(tmp_path, page, ["scatter_model.png", "error_cdf.png", "per_model.png"])
    assert "4.56" in page and "<b>4.56</b>" in page
    assert not (tmp_path / "scatter_ml.png").exists()


def test_text_is_escaped(tmp_path: Path) -> None:
    bad = "<script>alert(1)</script>$x$"
    models = [bad, "gpt2"]
    result = _result(models)
    result["dataset"] = "<b>ds</b>"
    preds = _predictions(models, ["piep", "direct"], LEVELS)
    page = write_report(result, preds, tmp_path).read_text(encoding="utf-8")
    assert "<script>" not in page and "<b>ds</b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;$x$" in page
    assert re.search(r"<style>", page) and "http" not in page


@pytest.mark.parametrize("measured", [0.0, float("nan")])
def test_unusable_measurements_are_skipped(tmp_path: Path, measured: float) -> None:
    models = ["gpt2"]
    preds = _predictions(models, ["piep"], LEVELS)
    preds.loc[preds.index[:5], "measured_j"] = measured
    result = _result(models)
    result["baselines"] = {}
    write_report(result, preds, tmp_path)
    assert (tmp_path / "error_cdf.png").read_bytes()[:4] == PNG
