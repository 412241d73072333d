"""Split-conformal intervals of the bundle's step energy (`calibrate.conformal`), without a server.

The rank rule is checked on residuals whose order statistics are known, and its coverage on
exchangeable synthetic data against the exact expectation (k_hi - k_lo) / (n + 1), with a
tolerance that the plain empirical quantile and numpy's interpolated quantile are shown to
fail. The campaign part runs `finish` (after the spans are read) on synthetic steps on the
real tree templates of a tiny-Llama campaign (tests/data/campaign_templates.json), and checks
that the residuals' predictions are the serve path's. A real campaign directory is finished
too when PIEP_CAMPAIGN_DIR names one (it is copied first; made by `calibrate run`, which
needs a server, so it is skipped otherwise).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console
from support.campaign_truth import DATA, DEVICE, IDLE, SHAPE, TRUE, WAITS

from vllm_piep.calibrate import conformal
from vllm_piep.calibrate import evaluate as ev
from vllm_piep.calibrate.campaign import CampaignPlan
from vllm_piep.calibrate.campaign_data import CampaignData, sync_quantiles
from vllm_piep.calibrate.campaign_train import (
    NoMeasuredStep,
    evaluate_campaign,
    fit_predictor,
    portable_model,
    train_bundle,
)
from vllm_piep.calibrate.conformal import ConformalError
from vllm_piep.calibrate.pipeline import (
    INTERVAL_JSON,
    finish_campaign,
    finish_data,
    remake_command,
    write_interval,
)
from vllm_piep.datasets.model import TreeDataset
from vllm_piep.model.flops import StepBatch, StepTotals
from vllm_piep.predict.base import StepInput
from vllm_piep.predict.bundle import TreeBundle
from vllm_piep.predict.served import SERVE_FEATURES, BundlePredictor, StepTemplate, step_nodes

MODEL = "/some/checkout/.cache/tiny-llama"  # an absolute path: the bundle must not keep it
SAMPLED_EVERY = 3  # every third step "replays" its leaves: leaves measured, time inflated


# --------------------------------------------------------------------------- the rank rule
@pytest.mark.parametrize(("n", "level", "ranks"), [
    (19, 0.9, (1, 19)),   # ceil(20 * 0.95) = 19: the smallest n at 90 %
    (30, 0.9, (1, 30)),   # ceil(31 * 0.95) = 30 (the plain rule: ceil(30 * 0.95) = 29)
    (39, 0.9, (2, 38)),   # ceil(40 * 0.95) = 38
    (100, 0.9, (5, 96)),  # ceil(101 * 0.95) = 96
    (9, 0.8, (1, 9)),     # a = 0.1: ceil(10 * 0.9) = 9
    (99, 0.8, (10, 90)),  # ceil(100 * 0.9) = 90
    (3, 0.5, (1, 3)),     # a = 0.25: ceil(4 * 0.75) = 3
])
def test_ranks_and_interval_on_known_order_statistics(n: int, level: float,
                                                      ranks: tuple[int, int]) -> None:
    assert conformal.conformal_ranks(n, level) == ranks
    # residuals whose k-th smallest is k / 1000, shuffled
    residuals = np.random.default_rng(n).permutation(np.arange(1, n + 1)) / 1000.0
    interval = conformal.split_conformal(residuals - 0.5 * (n + 1) / 1000.0, level)
    lo, hi = ranks
    assert interval.q_lo == pytest.approx(lo / 1000.0 - 0.5 * (n + 1) / 1000.0)
    assert interval.q_hi == pytest.approx(hi / 1000.0 - 0.5 * (n + 1) / 1000.0)
    assert interval.n == n
    assert interval.lower == pytest.approx(1.0 + interval.q_lo)
    assert interval.upper == pytest.approx(1.0 + interval.q_hi)


@pytest.mark.parametrize("level", [0.5, 0.8, 0.9, 0.95, 0.99, 0.7, 0.6])
def test_the_fewest_residuals_is_the_first_n_with_both_ranks(level: float) -> None:
    need = conformal.min_residuals(level)
    a = (1 - Fraction(str(level))) / 2  # exact: n >= (1 - a) / a
    assert need == math.ceil((1 - a) / a)
    lo, hi = conformal.conformal_ranks(need, level)
    assert 1 <= lo <= hi <= need
    with pytest.raises(ConformalError, match=f"at least {need}"):
        conformal.conformal_ranks(need - 1, level)
    with pytest.raises(ConformalError, match=f"{need - 1} residuals are too few"):
        conformal.split_conformal(np.linspace(-0.1, 0.1, need - 1), level)


def test_ninety_percent_needs_nineteen_residuals() -> None:
    assert conformal.min_residuals(0.9) == 19
    assert conformal.min_residuals(0.95) == 39
    with pytest.raises(ConformalError, match="18 residuals are too few for a 0.9 interval"):
        conformal.split_conformal(np.zeros(18))


@pytest.mark.parametrize("level", [0.0, 1.0, -0.5, 1.5])
def test_a_level_outside_the_unit_interval_is_refused(level: float) -> None:
    with pytest.raises(ConformalError, match="level"):
        conformal.split_conformal(np.zeros(100), level)


def test_non_finite_residuals_are_refused() -> None:
    with pytest.raises(ConformalError, match="not finite"):
        conformal.split_conformal(np.r_[np.zeros(30), np.nan])


def test_a_one_sided_residual_sample_still_contains_the_prediction() -> None:
    r = np.linspace(0.1, 0.3, 50)  # n = 50 at 90 %: ranks (2, 49)
    interval = conformal.split_conformal(r)
    assert interval.lower == 1.0 and interval.upper == pytest.approx(1 + r[48])
    assert interval.q_lo == pytest.approx(r[1])  # what was widened
    interval = conformal.split_conformal(-r)
    assert interval.upper == 1.0 and interval.lower == pytest.approx(1 - r[48])


# --------------------------------------------------------------------------- coverage
Rule = Callable[[np.ndarray, float], tuple[float, float]]


def _conformal_rule(r: np.ndarray, level: float) -> tuple[float, float]:
    iv = conformal.split_conformal(r, level)
    return iv.lower, iv.upper


def _plain_rule(r: np.ndarray, level: float) -> tuple[float, float]:
    """Deliberately wrong: the empirical quantile without the finite-sample correction."""
    s, n, a = np.sort(r), len(r), (1 - level) / 2
    k = math.ceil(n * (1 - a))
    return 1 + s[n - k], 1 + s[k - 1]


def _numpy_rule(r: np.ndarray, level: float) -> tuple[float, float]:
    """Deliberately wrong: numpy's interpolated quantiles."""
    a = (1 - level) / 2
    lo, hi = np.quantile(r, [a, 1 - a])
    return 1 + lo, 1 + hi


def _simulated_coverage(rule: Rule, n: int, level: float, trials: int = 3000,
                        per_trial: int = 20, seed: int = 0) -> float:
    """Mean fraction of fresh residuals inside the interval fitted on n, over trials
    (a skewed continuous distribution: nothing symmetric to hide behind)."""
    rng = np.random.default_rng(seed)
    inside = 0
    for _ in range(trials):
        r = rng.lognormal(0.0, 0.5, n + per_trial) - 1.0
        lo, hi = rule(r[:n], level)
        inside += int(((1 + r[n:] >= lo) & (1 + r[n:] <= hi)).sum())
    return inside / (trials * per_trial)


# The trial-to-trial spread of coverage at n = 30 is about 0.05, so the mean of 3000 trials
# is within 0.003 of its expectation (the fresh draws add less): 0.012 is four sigma.
TOL = 0.012


def _coverage_matches(rule: Rule, n: int, level: float) -> bool:
    lo, hi = conformal.conformal_ranks(n, level)
    expected = (hi - lo) / (n + 1)  # exact for continuous exchangeable residuals
    got = _simulated_coverage(rule, n, level)
    return abs(got - expected) < TOL and got >= level - TOL


@pytest.mark.parametrize(("n", "level"), [(30, 0.9), (19, 0.9), (60, 0.8)])
def test_the_conformal_rule_covers_as_the_rank_argument_says(n: int, level: float) -> None:
    assert _coverage_matches(_conformal_rule, n, level)


@pytest.mark.parametrize("rule", [_plain_rule, _numpy_rule])
def test_the_coverage_check_catches_an_uncorrected_quantile(rule: Rule) -> None:
    # at n = 30 the plain rule takes ranks (2, 29): 27/31 = 0.871 < 0.9
    assert not _coverage_matches(rule, 30, 0.9)


def test_split_coverage_is_near_the_level_on_exchangeable_residuals() -> None:
    r = np.random.default_rng(1).lognormal(0.0, 0.3, 400) - 1.0
    cov = conformal.split_coverage(r, 0.9, repeats=200, seed=3)
    # calibrating on 200: expected coverage in [0.9, 0.9 + 2/201]; the pool is one sample of
    # 400, whose own spread around that is about 0.015
    assert 0.875 < cov.mean < 0.94
    assert cov.p05 <= cov.mean <= cov.p95 and cov.p95 - cov.p05 > 0
    assert (cov.repeats, cov.test_fraction, cov.grouped_by) == (200, 0.5, None)
    assert cov.as_dict().keys() == {"mean", "p05", "p95", "repeats", "test_fraction",
                                    "grouped_by"}


def test_grouped_coverage_holds_out_whole_cells() -> None:
    """Cells with their own offsets (a bias per workload): a split by step calibrates on
    every cell's offset and looks fine, a split by cell meets unseen offsets and shows the
    interval's real coverage on a new workload, well below the level."""
    rng = np.random.default_rng(2)
    cells = np.repeat(np.arange(10), 40)
    r = rng.normal(0.0, 0.3, 10)[cells] + rng.normal(0.0, 0.02, len(cells))
    by_step = conformal.split_coverage(r, 0.9, seed=0)
    by_cell = conformal.split_coverage(r, 0.9, groups=[f"c{c}" for c in cells], seed=0)
    assert by_step.mean > 0.87
    assert by_cell.mean < 0.8
    assert by_cell.grouped_by == "cell" and by_cell.units == 10
    assert by_cell.distinct_splits == math.comb(10, 5)


def test_coverage_refuses_too_few_residuals_or_groups() -> None:
    with pytest.raises(ConformalError, match=r"needs 19, so about 38"):
        conformal.split_coverage(np.zeros(30), 0.9)
    with pytest.raises(ConformalError, match="at least two"):
        conformal.split_coverage(np.zeros(100), 0.9, groups=["a"] * 100)
    # two cells of 15: either half holds 15 < 19 residuals
    with pytest.raises(ConformalError, match="no split of 2 cells"):
        conformal.split_coverage(np.zeros(30), 0.9, groups=["a"] * 15 + ["b"] * 15)


# --------------------------------------------------------------------------- a campaign
@dataclasses.dataclass
class Synthetic:
    data: CampaignData
    batches: dict[str, StepBatch]


def _cell_batches(b: int, out_len: int, prompt: int = 24) -> list[StepBatch]:
    steps = [StepBatch.from_rows([(prompt, 0, 0, 1)] * b)]
    steps += [StepBatch.from_rows([(0, 1, prompt + i, 1)] * b) for i in range(1, out_len // 2)]
    return steps


def synthetic_campaign(seed: int = 0, noise: float = 0.1) -> Synthetic:
    """Steps of the quick grid (TP 1 and 2 x batch 1, 4 x 16, 48 tokens) on the real
    templates; leaves measured (on sampled steps) as linear in the serve features, each step's
    energy their sum times (1 + noise); sampled steps without a time of their own."""
    rng = np.random.default_rng(seed)
    frames, trees, batches = [], [], {}
    for config, rows in DATA["templates"].items():
        tp = int(config[2])
        shape = dataclasses.replace(SHAPE, tp=tp)
        template = StepTemplate.build(rows)
        for b in (1, 4):
            for out_len in (16, 48):
                for i, batch in enumerate(_cell_batches(b, out_len)):
                    tree_id = f"{config}/b{b}-o{out_len}/step{i}"
                    batches[tree_id] = batch
                    nodes = step_nodes(template, shape, StepTotals.of(batch), len(batch),
                                       WAITS.get(config, {}))
                    X = nodes[list(SERVE_FEATURES)].to_numpy(float)
                    coef = np.array([TRUE[t] if t in TRUE else (0,) * 6 for t in nodes.type])
                    leaf = template.is_leaf
                    truth = np.where(leaf, (X * coef).sum(axis=1), np.nan)
                    sampled = i % SAMPLED_EVERY == 1
                    energy = np.where(sampled, truth * rng.lognormal(0, 0.03, len(truth)),
                                      np.nan)
                    energy[(nodes.type == "overhead").to_numpy()] = np.nan
                    root = (nodes.parent_id == "").to_numpy()
                    energy[root] = np.nansum(truth[leaf]) * (1 + rng.normal(0, noise))
                    worker_s = 0.002 + 0.01 * X[root, 0][0] + 1e-4 * X[root, 1][0]
                    a = batch.array
                    frames.append(nodes.assign(
                        tree_id=tree_id, scope=nodes.node_id, energy_j=energy,
                        energy_source=np.where(np.isfinite(energy), "synthetic", ""),
                        time_s=np.where(root & (not sampled), worker_s, np.nan),
                        worker_s=worker_s * (3.0 if sampled else 1.0),  # replays
                        prefill_tokens=float(a[:, 0].sum()),
                        decode_tokens=float(a[:, 1].sum())))
                    trees.append({"tree_id": tree_id, "dataset": "campaign", "model": MODEL,
                                  "group": f"{config}/b{b}-o{out_len}", "hardware": DEVICE[1],
                                  "batch_size": float(b), "seq_len": float(out_len),
                                  "tp": float(tp), "pp": 1.0, "dp": 1.0})
    ds = TreeDataset.from_frames("campaign", pd.concat(frames, ignore_index=True),
                                 pd.DataFrame(trees), (*SERVE_FEATURES, "time_s", "worker_s",
                                                       "prefill_tokens", "decode_tokens",
                                                       "energy_source"))
    waits = pd.DataFrame([{"config": c, "op": op, "wait_s": w} for c, ops in WAITS.items()
                          for op, w in ops.items() for _ in range(3)])
    static = pd.DataFrame([{"config": c, "attempt": 1, "idle_watts": w,
                            "meter": "simulated (simulated)", "resolution_s": 0.01}
                           for c, w in IDLE.items()])
    samples = pd.DataFrame({c: pd.Series(dtype=float) for c in (
        "config", "tree_id", "node_id", "target", "calls", "window", "seconds",
        "joules_per_call")})
    summary = {"trees": len(trees), "cells": sorted({t["group"] for t in trees})}
    return Synthetic(CampaignData(ds, samples, sync_quantiles(waits), static, summary),
                     batches)


HEADER = {"model": MODEL, "architecture": DATA["architecture"], "shape": DATA["shape"]}


@pytest.fixture(scope="module")
def synthetic() -> Synthetic:
    return synthetic_campaign()


@pytest.fixture(scope="module")
def finished(synthetic: Synthetic, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("campaign")
    printed = io.StringIO()
    result = finish_data(out, synthetic.data, HEADER, "tests/test_conformal.py",
                         Console(file=printed, width=80), progress=False)
    return out, {**result, "printed": printed.getvalue()}


def test_residuals_are_out_of_fold(synthetic: Synthetic) -> None:
    fits: list[set[str]] = []

    def fit(ds: TreeDataset):  # type: ignore[no-untyped-def]
        fits.append(set(ds.trees.tree_id))
        return fit_predictor(ds)

    steps = conformal.out_of_fold_steps(synthetic.data, fit)
    fold = ev.folds(synthetic.data.dataset, "kfold")  # the evaluation's folds
    assert len(fits) == 3
    for name, train in zip(sorted(fold.unique()), fits):
        held = set(fold.index[fold == name])
        assert not train & held and train | held == set(fold.index)
    assert (steps.fold.to_numpy() == fold.reindex(steps.tree_id).to_numpy()).all()
    # sampled steps (no time of their own, replays in the worker's time) are not scored
    ds = synthetic.data.dataset
    clean = ds.nodes[(ds.nodes.parent_id == "") & ds.nodes.time_s.notna()].tree_id
    assert set(steps.tree_id) == set(clean) and len(steps) < len(ds.trees)
    assert np.isfinite(steps.residual).all()


def test_residuals_are_of_the_serve_paths_total_step_energy(synthetic: Synthetic,
                                                            finished: tuple[Path, dict]
                                                            ) -> None:
    """With every step in training, the residuals' prediction of a step is what the bundle
    predicts for it on the serve path (leaves clipped at 0, summed, plus idle power x the
    worker's step time), and the measured total is the dynamic energy plus idle power over
    the step."""
    out, _ = finished
    data = synthetic.data
    steps = conformal.out_of_fold_steps(data, fit_predictor, k=3)
    full = conformal.dynamic_step_joules(fit_predictor(data.dataset), data.dataset)
    bundle = TreeBundle.load(out / "bundle")
    checked = 0
    for row in steps.iloc[::7].itertuples():
        tp = int(row.config[2])
        served = BundlePredictor(bundle, dataclasses.replace(SHAPE, tp=tp)).predict_step(
            StepInput(synthetic.batches[row.tree_id], row.worker_s)).joules.sum()
        ours = full[row.tree_id] + IDLE[row.config] * row.worker_s
        assert ours == pytest.approx(served, rel=1e-6)
        root = data.dataset.nodes[(data.dataset.nodes.tree_id == row.tree_id)
                                  & (data.dataset.nodes.parent_id == "")].iloc[0]
        assert row.measured_j == pytest.approx(root.energy_j + IDLE[row.config] * root.time_s)
        # and the out-of-fold prediction is put together the same way
        assert row.predicted_j == pytest.approx(row.dynamic_pred_j + IDLE[row.config]
                                                * row.worker_s)
        assert row.residual == pytest.approx(row.measured_j / row.predicted_j - 1)
        checked += 1
    assert checked >= 5


def test_finish_writes_the_interval_into_the_manifest(finished: tuple[Path, dict]) -> None:
    out, result = finished
    manifest = json.loads((out / "bundle" / "manifest.json").read_text())
    iv = manifest["serving"]["interval"]
    assert set(iv) == {"level", "lower", "upper", "method", "residuals", "coverage"}
    assert iv["level"] == 0.9 and iv["lower"] <= 1.0 <= iv["upper"] and iv["lower"] > 0
    assert set(iv["coverage"]) == {"mean", "p05", "p95", "repeats", "test_fraction",
                                   "grouped_by"}
    assert iv["coverage"]["grouped_by"] == "cell" and iv["coverage"]["test_fraction"] == 0.5
    assert 0.0 <= iv["coverage"]["p05"] <= iv["coverage"]["mean"] <= iv["coverage"]["p95"] <= 1
    assert result["interval"] == iv
    # the multipliers are the conformal interval of the residuals the evaluation stored
    record = json.loads((out / "evaluation" / "interval.json").read_text())
    assert record["interval"] == iv
    steps = pd.read_parquet(out / "evaluation" / record["residuals_file"])
    again = conformal.split_conformal(steps.residual, iv["level"])
    assert (again.lower, again.upper, again.n) == (iv["lower"], iv["upper"], iv["residuals"])
    assert record["coverage_split_by_step"]["grouped_by"] is None
    # the interval is covered by the content hash, and the bundle loads and serves
    bundle = TreeBundle.load(out / "bundle")
    assert bundle.manifest["serving"]["interval"] == iv
    BundlePredictor(bundle, SHAPE)
    # the model is named from `.cache/`, not by this host's absolute path
    assert manifest["training_data"]["models"] == [".cache/tiny-llama"]
    assert manifest["serving"]["model"] == ".cache/tiny-llama"
    page = (out / "report" / "index.html").read_text()
    assert "Prediction interval (90%)" in page and (out / "report" / "interval.png").is_file()


def test_finish_warns_once_that_the_bundle_is_fitted_to_a_simulator(
        finished: tuple[Path, dict]) -> None:
    """The synthetic campaign's meter is `simulated`: one line says what the bundle will serve
    as."""
    _, result = finished
    lines = [x for x in result["printed"].splitlines() if x.startswith("warning:")]
    assert len(lines) == 1, result["printed"]
    assert "fitted to simulated" in lines[0] and '"source": "simulated"' in lines[0]


def test_the_interval_covers_new_noise_at_about_its_level(synthetic: Synthetic,
                                                          finished: tuple[Path, dict]) -> None:
    """Fresh steps of the same workloads with new noise, predicted by the shipped predictor:
    its multipliers hold about 90 % of their measured energies (the synthetic noise is alike
    in every cell, so the steps are exchangeable)."""
    out, _ = finished
    iv = json.loads((out / "bundle" / "manifest.json").read_text())["serving"]["interval"]
    predictor = fit_predictor(synthetic.data.dataset)  # the bundle's leaves
    r = []
    for seed in (11, 12):
        fresh = synthetic_campaign(seed=seed).data
        steps = conformal.measured_steps(fresh)
        dynamic = conformal.dynamic_step_joules(predictor, fresh.dataset)
        predicted = dynamic.reindex(steps.tree_id).to_numpy() + steps.static_watts * steps.worker_s
        r.append(steps.measured_j / predicted - 1)
    inside = conformal.Interval(0.9, iv["lower"] - 1, iv["upper"] - 1, 0).covers(pd.concat(r))
    # ~170 fresh steps and ends fitted on ~85: 0.9 within about +-0.04 (one sigma)
    assert 0.8 < inside.mean() < 0.98


def test_a_bundle_without_an_interval_still_loads(synthetic: Synthetic, tmp_path: Path) -> None:
    train_bundle(synthetic.data, tmp_path, device=DEVICE, header=HEADER, command="test",
                 metrics={})
    bundle = TreeBundle.load(tmp_path)
    assert "interval" not in bundle.manifest["serving"]
    BundlePredictor(bundle, SHAPE)


def test_finish_says_why_there_is_no_interval(tmp_path: Path) -> None:
    """Two cells of a few clean steps: too few residuals for a 90 % interval. The evaluation
    says why, and `finish` passes no interval to the bundle (which then states none)."""
    small = synthetic_campaign(seed=5)
    ds = small.data.dataset
    keep = ds.trees.tree_id[ds.trees.group.str.endswith("b1-o16")]
    data = dataclasses.replace(small.data, dataset=ds.subset(keep))
    record = write_interval(data, tmp_path, Console(quiet=True))
    assert "interval" not in record
    assert "residuals are too few for a 0.9 interval" in record["skipped"]
    assert json.loads((tmp_path / INTERVAL_JSON).read_text()) == record


@pytest.mark.parametrize(("given", "named"), [
    ("/check/work/main/.cache/tiny-llama", ".cache/tiny-llama"),
    (".cache/tiny-llama", ".cache/tiny-llama"),
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
    ("/root/.cache/huggingface/hub/models--x/snapshots/abc",
     "/root/.cache/huggingface/hub/models--x/snapshots/abc"),
    ("/data/models/tiny", "/data/models/tiny"),
])
def test_the_model_is_named_without_the_hosts_checkout(given: str, named: str) -> None:
    assert portable_model(given) == named
    command = remake_command(CampaignPlan.quick(given).model_dump())
    assert command == f"python -m vllm_piep.calibrate run --quick --model {named} --out DIR"


# --------------------------------------------------------------------------- a real campaign
def test_finish_on_a_real_campaign_writes_the_interval(tmp_path: Path) -> None:
    """`finish` on a copy of a campaign made by `calibrate run --quick` (PIEP_CAMPAIGN_DIR)."""
    source = os.environ.get("PIEP_CAMPAIGN_DIR")
    if not source or not (Path(source) / "campaign.json").is_file():
        pytest.skip("set PIEP_CAMPAIGN_DIR to a campaign directory (made by `calibrate run`, "
                    "which needs a server)")
    out = tmp_path / "campaign"
    shutil.copytree(source, out)
    result = finish_campaign(out, Console(quiet=True), progress=False)
    manifest = json.loads((out / "bundle" / "manifest.json").read_text())
    iv = manifest["serving"]["interval"]
    assert result["interval"] == iv and iv["lower"] <= 1.0 <= iv["upper"]
    assert iv["coverage"]["grouped_by"] == "cell" and iv["coverage"]["repeats"] == 200
    data = CampaignData.load(out / "dataset")
    n = data.dataset.nodes
    clean = (n.parent_id == "") & n.energy_j.notna() & n.time_s.notna() & (n.worker_s > 0)
    assert iv["residuals"] == int(clean.sum())
    TreeBundle.load(out / "bundle")


def test_a_fold_that_trains_on_no_measured_step_is_reported_missing(synthetic: Synthetic
                                                                     ) -> None:
    """TP 1's steps unmeasured (too fast for the meter): leaving TP 2 out trains on no
    measured step, which that fold reports missing; the other protocols still score."""
    ds = synthetic.data.dataset
    nodes = ds.nodes.copy()
    tp1 = ds.trees.tree_id[ds.trees.tp == 1]
    nodes.loc[(nodes.parent_id == "") & nodes.tree_id.isin(tp1), "energy_j"] = np.nan
    ds = TreeDataset(ds.name, nodes, ds.trees, ds.features, ds.issues)
    with pytest.raises(NoMeasuredStep):
        fit_predictor(TreeDataset(ds.name, nodes[nodes.tree_id.isin(tp1)],
                                  ds.trees[ds.trees.tp == 1], ds.features, ds.issues))
    per_fold = evaluate_campaign(ds, progress=False)["leave-one-tp-out"]["per_fold"]
    assert per_fold["tp 1"]["module"]["n"] > 0  # trained on TP 2's measured steps
    assert per_fold["tp 2"]["model"]["n"] == 0 and per_fold["tp 2"]["model"]["n_missing"] > 0
