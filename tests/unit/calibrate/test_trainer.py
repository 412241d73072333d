"""The trainer on IrEne's and ML.ENERGY's published measurements: tree rebuild, the combiner's
gradient, consistency through the tree, no leak from the held-out model, the targets,
ONNX parity, the manifest, and the evaluation CLI's JSON contract."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from support.paths import PUBLISHED_DATA

from vllm_piep.calibrate import evaluate as ev
from vllm_piep.calibrate.export import export_bundle
from vllm_piep.calibrate.train import TreeCombiner, TreePredictor
from vllm_piep.datasets.irene import load_irene
from vllm_piep.datasets.model import BadRows, DatasetError
from vllm_piep.predict.bundle import BundleError, TreeBundle
from vllm_piep.predict.featurespec import FeatureSchemaError
from vllm_piep.predict.treeeval import TreeIndex, UncoveredLeaves

DATA = PUBLISHED_DATA
IRENE = DATA / "irene" / "device_1"
MLENERGY_ARGS = ("--dataset", "mlenergy", "--data", str(DATA / "mlenergy-v2" / "a100_configs.csv"),
                 "--structures", str(DATA / "model_structures.csv"))


def evaluate_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m vllm_piep.calibrate evaluate ARGS --no-progress` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "vllm_piep.calibrate", "evaluate", *args,
                           "--no-progress"], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def irene():
    return load_irene(IRENE)


def test_tree_rebuilt_from_scopes(irene):
    n = irene.nodes[irene.nodes.tree_id == "irene/gpt2/b8/s32"].set_index("node_id")
    assert n.loc["h.0.attn.c_attn:Conv1D#0", "parent_id"] == "h.0.attn:Attention"
    assert n.loc["h.0.attn:Attention", "parent_id"] == "h.0:Block"
    assert n.loc["h.0:Block", "parent_id"] == "model"
    # the two attention MatMuls are both kept, under the attention module
    assert n.loc["h.0.attn:MatMul#1", "parent_id"] == "h.0.attn:Attention"
    assert n.loc["model", "level"] == "model" and n.loc["model", "parent_id"] == ""


@pytest.mark.slow
def test_bad_rows_reported_with_file_and_line(irene, tmp_path):
    # The real data has ml2 rows of an openai-gpt configuration that has no model row.
    assert irene.issues and all("orphan" in i.reason for i in irene.issues)
    raw = IRENE / "ml2_level_features.csv"
    lines = raw.read_text().splitlines()
    orphan_lines = {i.line for i in irene.issues}
    assert all(",openai-gpt" in lines[k - 1] for k in orphan_lines)
    # A copy with a non-positive energy and a missing value.
    for f in IRENE.iterdir():
        shutil.copy(f, tmp_path / f.name)
    path = tmp_path / "module_level_features.csv"
    rows = path.read_text().splitlines()
    head = rows[0].split(",")
    cells = rows[5].split(",")
    cells[head.index("energy_mean")] = "0"
    rows[5] = ",".join(cells)
    cells = rows[9].split(",")
    cells[head.index("times_mean")] = ""
    rows[9] = ",".join(cells)
    path.write_text("\n".join(rows) + "\n")
    ds = load_irene(tmp_path)
    mine = {(Path(i.file).name, i.line): i.reason for i in ds.issues}
    assert "not positive" in mine[("module_level_features.csv", 6)]
    assert "time_s" in mine[("module_level_features.csv", 10)]
    with pytest.raises(DatasetError, match="module_level_features.csv:6"):
        load_irene(tmp_path, BadRows.REJECT)
    # A missing column refuses the file.
    df = pd.read_csv(path).drop(columns=["gpu_energy_mean"])
    df.to_csv(path, index=False)
    with pytest.raises(DatasetError, match="gpu_energy_mean"):
        load_irene(tmp_path)


def test_combiner_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    # two small trees: root <- (a <- (l1, l2)), l3
    index = TreeIndex.build(["t"] * 5 + ["u"] * 3,
                            ["r", "a", "l1", "l2", "l3", "r", "l1", "l2"],
                            ["", "r", "a", "a", "r", "", "r", "r"])
    Z = rng.normal(size=(8, 3))
    leaf = rng.uniform(1, 2, size=8)
    measured = np.array([6.0, 3.5, np.nan, np.nan, np.nan, 3.1, np.nan, np.nan])
    comb = TreeCombiner(tau=2.0, l2=0.0).fit(Z, index, leaf, measured)  # sets the scaler
    theta = rng.normal(size=4) * 0.3

    def loss(th):
        comb.coef_, comb.intercept_ = th[:-1], th[-1]
        P = index.aggregate(leaf, comb.alpha(Z))
        target = ~index.is_leaf & np.isfinite(measured)
        return float((((P - measured) / measured)[target] ** 2).sum()) / target.sum()

    import scipy.optimize as so
    numeric = so.approx_fprime(theta, loss, 1e-7)
    captured = {}

    def fake_minimize(fun, x0, jac, method, options):  # evaluate the closure at theta once
        captured["value"], captured["grad"] = fun(theta)
        return SimpleNamespace(x=theta, fun=captured["value"], success=True, message="")
    import vllm_piep.calibrate.train as train_mod
    original = train_mod.minimize
    train_mod.minimize = fake_minimize
    try:
        TreeCombiner(tau=2.0, l2=0.0).fit(Z, index, leaf, measured)
    finally:
        train_mod.minimize = original
    assert captured["value"] == pytest.approx(loss(theta), rel=1e-12)
    np.testing.assert_allclose(captured["grad"], numeric, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("params", [{}, {"combiner": "end2end"}, {"model_level": True}])
def test_predictions_are_consistent_through_the_tree(irene, params):
    """Below the root every inner node is exactly the alpha-weighted sum of its children; the
    root is that sum, or with the model-level regressor its weighted sum of the same leaves'
    shares by component plus a fixed energy. Either way the leaves' shares explain it."""
    train = irene.where_model(["gpt2", "bert-base-uncased", "distilbert-base-uncased"])
    model = TreePredictor(**params).fit(train)
    nodes = model.predict(irene.where_model(["distilgpt2"])).nodes
    alpha = (np.ones(len(nodes)) if model.combiner_ is None
             else model.combiner_.alpha(model.combiner_spec_.matrix(nodes)))
    assert np.all(np.abs(alpha - 1) <= 1 / model.tau)
    index = TreeIndex.build(nodes.tree_id.tolist(), nodes.node_id.tolist(),
                            nodes.parent_id.tolist())
    tree = nodes.tree_pred_j.to_numpy()
    sums = np.zeros(len(nodes))
    np.add.at(sums, index.parent[index.parent >= 0], (alpha * tree)[index.parent >= 0])
    inner = ~index.is_leaf
    np.testing.assert_allclose(tree[inner], sums[inner], rtol=1e-12)
    below_root = index.parent >= 0
    np.testing.assert_array_equal(nodes.predicted_j.to_numpy()[below_root], tree[below_root])
    share = index.path_weight(alpha) * tree
    roots = np.flatnonzero(index.parent < 0)
    leaves = index.is_leaf & (index.parent >= 0)
    tree_of = nodes.tree_id.to_numpy()
    comp = nodes.component.to_numpy()
    for r in roots[:5]:
        mine = leaves & (tree_of == tree_of[r])
        assert share[mine].sum() == pytest.approx(tree[r], rel=1e-12)
        if model.model_regressor_ is not None:
            reg = model.model_regressor_.model_
            col = {c: j for j, c in enumerate(model.model_regressor_.components)}
            weight = np.array([reg.coef_[col.get(c, col["other"])] for c in comp[mine]])
            assert (weight * share[mine]).sum() + reg.intercept_ == pytest.approx(
                nodes.predicted_j.to_numpy()[r], rel=1e-9)
        else:
            assert nodes.predicted_j.to_numpy()[r] == tree[r]


def test_held_out_model_never_reaches_training(irene):
    """Methods see the held-out trees with blanked energies, and multiplying the held-out
    model's measured energies by 7 changes none of its predictions."""
    seen = []

    def probe(train, test):
        seen.append((set(train.models), set(test.models), test.nodes.energy_j.notna().any()))
        return pd.Series(dtype=float)
    ev.leave_one_model_out(irene, [ev.Method("probe", probe, "")], progress=False)
    assert len(seen) == 7
    for train_models, test_models, test_has_energy in seen:
        assert len(test_models) == 1 and not (train_models & test_models)
        assert not test_has_energy
    held = "distilgpt2"
    method = ev.irene_methods(irene.features)[0]
    before = ev.leave_one_model_out(irene, [method], models=[held], progress=False)
    scaled = irene.subset(irene.trees.tree_id)
    mask = scaled.nodes.tree_id.str.startswith(f"irene/{held}/")
    scaled.nodes = scaled.nodes.assign(energy_j=np.where(mask, scaled.nodes.energy_j * 7,
                                                         scaled.nodes.energy_j))
    after = ev.leave_one_model_out(scaled, [method], models=[held], progress=False)
    np.testing.assert_array_equal(before.predictions.predicted_j, after.predictions.predicted_j)
    np.testing.assert_allclose(after.predictions.measured_j, before.predictions.measured_j * 7)


def test_untrained_leaves_are_an_error_not_zero_joules(irene):
    """Unmeasured leaves (modules shorter than the meter's resolution) leave nothing to fit:
    the trainer says so instead of predicting 0 J for them."""
    data = irene.where_model(["gpt2", "distilgpt2"])
    data.nodes = data.nodes.assign(energy_j=data.nodes.energy_j.where(
        data.nodes.level != "ml"))
    with pytest.raises(UncoveredLeaves, match="ml:"):
        TreePredictor().fit(data)


@pytest.mark.slow
def test_irene_cli_contract_ablations_and_targets(irene, tmp_path):
    """The fixed CLI on irene/device_1, leave-one-model-out over all 7 models: the JSON
    contract, IrEne's ablations and the baselines present, and the bar met: below the
    best simple regression at every level (model 3.9, module 2.3, ML 0.7 %)."""
    out = tmp_path / "irene.json"
    proc = evaluate_cli("--dataset", "irene", "--data", str(IRENE), "--protocol",
                        "leave-one-model-out", "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert (result["dataset"], result["protocol"], result["n_trees"]) == (
        "irene", "leave-one-model-out", len(irene.trees))
    assert set(result["per_model"]) == set(irene.models) and len(irene.models) == 7
    assert {"predicted_sum", "stepwise", "unstructured", "end2end", "direct",
            "gpu_only"} <= set(result["baselines"])
    assert len(result["bad_rows"]) == len(irene.issues)
    for level, bar in ev.IRENE_TARGETS.items():
        assert result["levels"][level]["mape"] < bar, (level, result["levels"][level])
        assert result["levels"][level]["n_missing"] == 0
        assert result["levels"][level]["n"] == int((irene.nodes.level == level).sum())
    preds = pd.read_parquet(out.with_name(result["predictions_file"]))
    assert set(preds.method) == {"piep", *result["baselines"]}


@pytest.mark.slow
def test_mlenergy_target_and_baselines():
    from vllm_piep.datasets.mlenergy import is_multimodal, load_mlenergy
    ds = load_mlenergy(DATA / "mlenergy-v2" / "a100_configs.csv", DATA / "model_structures.csv")
    text = ds.subset(ds.trees.tree_id[~is_multimodal(ds.trees)])
    result = ev.result_json(ev.leave_one_model_out(text, ev.mlenergy_methods(), progress=False))
    main = result["levels"]["model"]["mape"]
    assert main < ev.MLENERGY_TARGETS["model"]
    for name in ("wilkins", "params", "loglinear"):
        assert result["baselines"][name]["levels"]["model"]["mape"] > main


def test_onnx_bundle_equals_training_predictions(irene, tmp_path, monkeypatch):
    held = "sshleifer/tiny-ctrl"
    train, test = irene.where_model([held], keep=False), irene.where_model([held])
    model = TreePredictor().fit(train)
    expected = model.predict(test).nodes
    export_bundle(model, train, tmp_path / "b", hardware="irene/device_1", command="test")
    assert sorted(p.suffix for p in (tmp_path / "b").iterdir()) == sorted(
        [".json"] + [".onnx"] * (len(list((tmp_path / "b").glob("*.onnx")))))

    def no_pickle(*a, **k):
        raise AssertionError("unpickling at load/predict time")
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    got = TreeBundle.load(tmp_path / "b").predict(test.nodes)
    assert list(got.node_id) == list(expected.node_id)
    ref = expected.predicted_j.to_numpy()
    rel = np.abs(got.predicted_j.to_numpy() - ref) / np.abs(ref)
    assert np.all(rel <= 1e-5), rel.max()


def test_bundle_refuses_bad_manifest_files_and_features(irene, tmp_path):
    train = irene.where_model(["gpt2", "distilgpt2"])
    export_bundle(TreePredictor().fit(train), train, tmp_path / "b", hardware="x",
                  command="test")
    bundle = TreeBundle.load(tmp_path / "b")
    with pytest.raises(FeatureSchemaError, match="gpu_util_pct"):
        bundle.predict(irene.where_model(["gpt2"]).nodes.drop(columns=["gpu_util_pct"]))
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    swapped = json.loads(json.dumps(manifest))
    leaf = swapped["features"]["leaf"]
    leaf[0], leaf[1] = leaf[1], leaf[0]
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(swapped))
    with pytest.raises(BundleError, match="content_sha256"):
        TreeBundle.load(tmp_path / "b")
    broken = dict(manifest, leaves=[])
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(broken))
    with pytest.raises(BundleError, match="leaves"):
        TreeBundle.load(tmp_path / "b")
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    onnx_file = tmp_path / "b" / manifest["leaves"][0]["file"]
    onnx_file.write_bytes(onnx_file.read_bytes()[:-7])
    with pytest.raises(BundleError, match="SHA-256"):
        TreeBundle.load(tmp_path / "b")


@pytest.mark.slow
def test_evaluate_cli_contract(tmp_path):
    out = tmp_path / "mlenergy.json"
    proc = evaluate_cli(*MLENERGY_ARGS, "--protocol", "leave-one-model-out", "--json", str(out),
                        "--html", str(tmp_path / "html"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    for key in ("dataset", "protocol", "n_trees", "levels", "per_model", "baselines"):
        assert key in result
    assert result["dataset"] == "mlenergy" and result["protocol"] == "leave-one-model-out"
    assert set(result["levels"]) == {"model"}
    assert {"mape", "n"} <= set(result["levels"]["model"])
    assert {"wilkins", "params", "loglinear"} <= set(result["baselines"])
    assert "NVML" in result["ground_truth"]  # every figure names what measured it
    assert result["multimodal"]["levels"]["model"]["n"] > 0
    assert "piep" in proc.stdout and "wilkins" in proc.stdout
    assert (tmp_path / "html" / "index.html").is_file()
    bad = evaluate_cli("--dataset", "irene", "--data", str(tmp_path), "--json",
                       str(tmp_path / "x.json"), timeout=120)
    assert bad.returncode == 2 and "missing" in bad.stderr


@pytest.mark.slow
def test_mlenergy_train_cli_bundle_equals_the_evaluated_predictor(tmp_path):
    """`train --dataset mlenergy` exports the predictor that `evaluate` scores (text LLMs,
    log power x device-seconds), and onnxruntime reproduces it."""
    from vllm_piep.calibrate.__main__ import main
    from vllm_piep.datasets.mlenergy import is_multimodal, load_mlenergy
    csv, structures = DATA / "mlenergy-v2" / "a100_configs.csv", DATA / "model_structures.csv"
    assert main(["train", "--dataset", "mlenergy", "--data", str(csv), "--structures",
                 str(structures), "--out", str(tmp_path / "b")]) == 0
    ds = load_mlenergy(csv, structures)
    text = ds.subset(ds.trees.tree_id[~is_multimodal(ds.trees)])
    expected = TreePredictor(**ev.mlenergy_predictor()).fit(text).predict(text).nodes
    bundle = TreeBundle.load(tmp_path / "b")
    assert bundle.manifest["training_data"]["trees"] == len(text.trees)
    assert "NVML" in bundle.manifest["training_data"]["ground_truth"]
    got = bundle.predict(text.nodes)
    np.testing.assert_allclose(got.predicted_j, expected.predicted_j, rtol=1e-5)


def test_protocols_hold_out_whole_groups(irene):
    """Leave-one-batch-out and k-fold hold out whole groups of trees; a protocol with one
    group (IrEne ran at TP 1 only) is refused with a clear message."""
    by_batch = ev.folds(irene, "leave-one-batch-out")
    assert set(by_batch) == {f"batch {b:g}" for b in irene.trees.batch_size.unique()}
    trees = irene.trees.set_index("tree_id")
    assert (by_batch == "batch " + trees.batch_size.map(lambda v: f"{v:g}")).all()
    kfold = ev.folds(irene, "kfold")
    assert kfold.nunique() == 3 and kfold.value_counts().max() - kfold.value_counts().min() <= 1
    with pytest.raises(ev.ProtocolError, match="tp 1"):
        ev.folds(irene, "leave-one-tp-out")
    seen = []
    probe = ev.Method("probe", lambda tr, te: seen.append(
        (set(tr.trees.batch_size), set(te.trees.batch_size))) or pd.Series(dtype=float), "")
    ev.evaluate_protocol(irene, [probe], "leave-one-batch-out", progress=False)
    assert len(seen) == irene.trees.batch_size.nunique()
    for train_batches, test_batches in seen:
        assert len(test_batches) == 1 and not (train_batches & test_batches)


@pytest.mark.slow
def test_mlenergy_leave_one_tp_out_cli(tmp_path):
    out = tmp_path / "tp.json"
    proc = evaluate_cli(*MLENERGY_ARGS, "--protocol", "leave-one-tp-out", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["protocol"] == "leave-one-tp-out" and "targets" not in result
    assert set(result["per_fold"]) == {"tp 1", "tp 2", "tp 4", "tp 8"}
    bad = evaluate_cli("--dataset", "irene", "--data", str(IRENE), "--protocol",
                       "leave-one-tp-out", "--json", str(tmp_path / "x.json"))
    assert bad.returncode == 2 and "at least two groups" in bad.stderr
