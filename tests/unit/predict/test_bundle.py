"""A campaign bundle on the serve path, without a server: training on the serve features,
the fast serve prediction against the bundle's reference evaluation, bundle selection with
its fallback to the prior, what-if, and the repeated-sampling decisions.

The training data are synthetic trees on the real tree templates of a tiny-Llama campaign
(tests/data/campaign_templates.json), with leaf energies linear in the serve features by known
coefficients: a bundle that reads other features at serve time than it was trained on, or
sums the tree differently, cannot reproduce them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from support.campaign_truth import DATA, DEVICE, IDLE, SHAPE, TRUE, WAITS
from support.paths import SHIPPED_BUNDLE

from vllm_piep.calibrate.campaign_data import CampaignData, sync_quantiles
from vllm_piep.calibrate.campaign_train import train_bundle
from vllm_piep.config import ConfigError, PiepConfig
from vllm_piep.datasets.model import TreeDataset
from vllm_piep.model.flops import ModelShape, StepBatch, StepTotals
from vllm_piep.predict.base import StepInput
from vllm_piep.predict.bundle import TreeBundle, content_digest
from vllm_piep.predict.loader import load_predictor
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.predict.served import (
    SERVE_FEATURES,
    BundlePredictor,
    StepTemplate,
    reference_step_joules,
    step_nodes,
)


def _batch(rng: np.random.Generator) -> StepBatch:
    n = int(rng.integers(1, 9))
    if rng.random() < 0.3:
        return StepBatch.from_rows([(int(rng.integers(4, 40)), 0, 0, 1) for _ in range(n)])
    return StepBatch.from_rows([(0, 1, int(rng.integers(1, 120)), 1) for _ in range(n)])


def synthetic_campaign(seed: int = 0, steps: int = 60) -> CampaignData:
    rng = np.random.default_rng(seed)
    frames, trees = [], []
    for config, rows in DATA["templates"].items():
        tp = int(config[2])
        shape = dataclasses.replace(SHAPE, tp=tp)
        template = StepTemplate.build(rows)
        for i in range(steps):
            batch = _batch(rng)
            nodes = step_nodes(template, shape, StepTotals.of(batch), len(batch),
                               WAITS.get(config, {}))
            tree_id = f"{config}/step{i}"
            X = nodes[list(SERVE_FEATURES)].to_numpy(float)
            coef = np.array([TRUE.get(t, (0,) * 6) for t in nodes.type], dtype=float)
            leaf = template.is_leaf
            energy = np.where(leaf, (X * coef).sum(axis=1), np.nan)
            root = nodes.parent_id == ""
            energy[root.to_numpy()] = np.nansum(energy[leaf])
            a = batch.array
            nodes = nodes.assign(
                tree_id=tree_id, scope=nodes.node_id, energy_j=energy,
                energy_source=np.where(np.isfinite(energy), "synthetic", ""),
                time_s=np.where(root, 0.002 + 0.01 * nodes.gflop + 1e-4 * nodes.mem_mib,
                                np.nan),
                worker_s=0.002 + 0.01 * nodes.gflop.iloc[0] + 1e-4 * nodes.mem_mib.iloc[0],
                prefill_tokens=float(a[:, 0].sum()), decode_tokens=float(a[:, 1].sum()))
            frames.append(nodes)
            trees.append({"tree_id": tree_id, "dataset": "campaign", "model": "tiny",
                          "group": f"{config}/b{len(batch)}", "hardware": DEVICE[1],
                          "batch_size": float(len(batch)), "seq_len": 8.0, "tp": float(tp),
                          "pp": 1.0, "dp": 1.0})
    ds = TreeDataset.from_frames("campaign", pd.concat(frames, ignore_index=True),
                                 pd.DataFrame(trees), (*SERVE_FEATURES, "time_s", "worker_s",
                                                       "prefill_tokens", "decode_tokens",
                                                       "energy_source"))
    waits = pd.DataFrame([{"config": c, "op": op, "wait_s": w} for c, ops in WAITS.items()
                          for op, w in ops.items() for _ in range(3)])
    static = pd.DataFrame([{"config": c, "attempt": 1, "idle_watts": w,
                            "meter": "simulated (simulated)", "resolution_s": 0.01}
                           for c, w in IDLE.items()])
    return CampaignData(ds, pd.DataFrame(), sync_quantiles(waits), static, {})


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle")
    header = {"model": DATA["model"], "architecture": DATA["architecture"],
              "shape": DATA["shape"]}
    train_bundle(synthetic_campaign(), out, device=DEVICE, header=header,
                 command="tests/test_bundle_serving.py", metrics={})
    return out


def _random_steps(seed: int, n: int = 25) -> list[StepBatch]:
    rng = np.random.default_rng(seed)
    return [_batch(rng) for _ in range(n)]


@pytest.mark.parametrize("tp", [1, 2])
def test_bundle_recovers_the_known_leaves_on_new_steps(bundle_dir: Path, tp: int) -> None:
    shape = dataclasses.replace(SHAPE, tp=tp)
    predictor = BundlePredictor(TreeBundle.load(bundle_dir), shape)
    config = f"tp{tp}-pp1"
    for batch in _random_steps(seed=100 + tp):
        nodes = step_nodes(predictor.template, shape, StepTotals.of(batch), len(batch),
                           WAITS.get(config, {}))
        X = nodes[list(SERVE_FEATURES)].to_numpy(float)
        coef = np.array([TRUE.get(t, (0,) * 6) for t in nodes.type], dtype=float)
        truth = (X * coef).sum(axis=1)[predictor.template.is_leaf].sum() + IDLE[config] * 0.01
        got = predictor.predict_step(StepInput(batch, 0.01)).joules.sum()
        assert got == pytest.approx(truth, rel=1e-6)


@pytest.mark.parametrize("tp", [1, 2])
def test_serve_prediction_equals_the_reference_evaluation(bundle_dir: Path, tp: int) -> None:
    bundle = TreeBundle.load(bundle_dir)
    shape = dataclasses.replace(SHAPE, tp=tp)
    predictor = BundlePredictor(bundle, shape)
    for batch in _random_steps(seed=tp):
        step = StepInput(batch, 0.0123)
        energy = predictor.predict_step(step)
        reference = reference_step_joules(bundle, shape, StepTotals.of(batch), len(batch), 0.0123)
        assert energy.joules.sum() == pytest.approx(reference, rel=1e-9)
        assert energy.joules.min() >= 0
        assert energy.work.shape == (len(batch), len(energy.joules))


def test_breakdown_names_collectives_only_under_tensor_parallelism(bundle_dir: Path) -> None:
    from vllm_piep.model.components import INDEX

    batch = StepBatch.from_rows([(0, 1, 40, 1)] * 4)
    one = BundlePredictor(TreeBundle.load(bundle_dir), SHAPE).predict_step(
        StepInput(batch, 0.01)).joules
    two = BundlePredictor(TreeBundle.load(bundle_dir), dataclasses.replace(SHAPE, tp=2)
                          ).predict_step(StepInput(batch, 0.01)).joules
    for comp in ("allreduce", "sync_wait"):
        assert one[INDEX[comp]] == 0
        assert two[INDEX[comp]] > 0
    assert one[INDEX["static"]] > IDLE["tp1-pp1"] * 0.01  # idle power plus the overhead leaf


def test_manifest_states_the_serve_features_and_how_to_remake(bundle_dir: Path) -> None:
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    serving = manifest["serving"]
    assert serving["features_supplied_by_serve_path"] == list(SERVE_FEATURES)
    assert "time_s" in serving["detail_only_features"]
    assert set(manifest["features"]["inputs"]) <= set(SERVE_FEATURES)
    assert manifest["how_to_remake"] == "tests/test_bundle_serving.py"
    assert serving["wait_s"] == WAITS
    assert "step_time.onnx" in manifest["sha256"]


def _config(bundle: str) -> PiepConfig:
    return PiepConfig.from_sources({"piep": {"bundle": bundle}}, environ={})


def test_loader_serves_a_fitting_bundle(bundle_dir: Path) -> None:
    predictor = load_predictor(_config(str(bundle_dir)), SHAPE, *DEVICE,
                               architecture=DATA["architecture"])
    # the synthetic campaign's meter is the simulator: the bundle says so
    assert predictor.source == "simulated"
    assert predictor.bundle_id.startswith("campaign-")
    assert predictor.bundle_id.endswith(" (fit to simulated)")


def relabelled(bundle_dir: Path, out: Path, meter: str) -> TreeBundle:
    """The bundle with another `serving.meter`, its content digest remade (a valid bundle)."""
    shutil.copytree(bundle_dir, out)
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["serving"]["meter"] = meter
    manifest["content_sha256"] = content_digest(manifest)
    path.write_text(json.dumps(manifest, indent=1))
    return TreeBundle.load(out)


@pytest.mark.parametrize("meter,source,suffix", [
    ("cpu-estimate (estimated)", "estimated", " (fit to cpu-estimate)"),
    ("simulated (simulated)", "simulated", " (fit to simulated)"),
    ("nvml+rapl (measured)", "calibrated", ""),
    ("rapl (measured)", "calibrated", ""),
    ("a wall meter", "calibrated", ""),  # a label that does not say its kind
])
def test_a_bundle_serves_as_what_its_meter_is(bundle_dir: Path, tmp_path: Path, meter: str,
                                             source: str, suffix: str) -> None:
    """Only a bundle fitted to a meter that measures says `calibrated`."""
    bundle = relabelled(bundle_dir, tmp_path / "bundle", meter)
    predictor = BundlePredictor(bundle, SHAPE)
    assert predictor.source == source
    assert predictor.bundle_id == bundle.bundle_id + suffix


def test_the_shipped_bundle_serves_as_an_estimate() -> None:
    """It was made on a CPU estimate (its manifest says so), so it is not `calibrated`."""
    bundle = TreeBundle.load(SHIPPED_BUNDLE)
    assert bundle.manifest["serving"]["meter"] == "cpu-estimate (estimated)"
    shape = ModelShape(**bundle.manifest["serving"]["shape"])
    predictor = BundlePredictor(bundle, shape)
    assert predictor.source == "estimated"
    assert predictor.bundle_id == f"{bundle.bundle_id} (fit to cpu-estimate)"


@pytest.mark.parametrize("case", ["other dtype", "other model", "other cpu", "missing",
                                  "corrupt onnx"])
def test_loader_falls_back_to_the_prior_with_one_warning(
        bundle_dir: Path, tmp_path: Path, case: str,
        caplog: pytest.LogCaptureFixture) -> None:
    path, shape, device = bundle_dir, SHAPE, DEVICE
    if case == "other dtype":
        shape = dataclasses.replace(SHAPE, dtype_bytes=2)
    elif case == "other model":
        shape = dataclasses.replace(SHAPE, layers=SHAPE.layers + 2)
    elif case == "other cpu":
        device = ("cpu", "Another CPU")
    elif case == "missing":
        path = tmp_path / "nothing-here"
    else:
        path = tmp_path / "copy"
        shutil.copytree(bundle_dir, path)
        (path / "leaf_000.onnx").write_bytes(b"not onnx")
    with caplog.at_level(logging.WARNING):
        predictor = load_predictor(_config(str(path)), shape, *device,
                                   architecture=DATA["architecture"])
    assert isinstance(predictor, PriorPredictor)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "analytic prior" in text
    expected = {"other dtype": "dtype", "other model": "layers", "other cpu": "Another CPU",
                "missing": "no manifest.json", "corrupt onnx": "SHA-256"}[case]
    assert expected in text


def test_sampling_needs_detail_mode() -> None:
    with pytest.raises(ConfigError, match="detail"):
        PiepConfig.from_sources({"piep": {"sampling": {"windows": 2}}}, environ={})
    with pytest.raises(ConfigError, match="windows"):
        PiepConfig.from_sources({"piep": {"mode": "detail", "spans_dir": "/x",
                                          "sampling": {"windows": 1}}}, environ={})
