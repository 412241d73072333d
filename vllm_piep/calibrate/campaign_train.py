"""Train, evaluate and export the bundle of a campaign (`calibrate run`).

The predictor is the trainer's `TreePredictor` with leaves per node type on the serve path's
features only (`predict.served.SERVE_FEATURES`), summed up the tree (the campaign measures
every leaf and the step, so nothing is left to a combiner or a `self` leaf: the step's work
outside the modules is the measured `overhead` leaf). It is evaluated by 3-fold
cross-validation over steps and by leaving out a batch size and a TP degree (PIE-P Table 3),
against a token-count regression (Wilkins et al.) and the flat per-level regression. The
bundle adds what the serve path needs (`serving`): tree templates per configuration, idle
power, mean synchronization waits, the hardware and model it fits, and a step-time model for
what-if questions, and a split-conformal prediction interval of the total step energy from
out-of-fold residuals (`conformal`), with its coverage on held-out cells.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pandas as pd
from sklearn.linear_model import LinearRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from vllm_piep.calibrate import conformal
from vllm_piep.calibrate import evaluate as ev
from vllm_piep.calibrate.campaign_data import OVERHEAD, QUANTILES, CampaignData
from vllm_piep.calibrate.export import _sklearn_onnx, export_bundle
from vllm_piep.calibrate.train import EnergyRegressor, TreePredictor
from vllm_piep.datasets.model import TreeDataset
from vllm_piep.predict.featurespec import FeatureSpec
from vllm_piep.predict.served import SERVE_FEATURES, template_of
from vllm_piep.predict.treeeval import UncoveredLeaves

PROTOCOLS = ("kfold", "leave-one-batch-out", "leave-one-tp-out")
STEP_TIME_FEATURES = ("gflop", "mem_mib", "comm_mib", "calls", "batch_size")
# What only detail mode measures: for training the leaves, never read at serve time.
DETAIL_ONLY = ("time_s", "energy_j (replayed modules and collectives, per-rank waits)",
               "resource features")


def predictor_params() -> dict[str, Any]:
    return {"combiner": "sum", "self_nodes": False, "leaf_scope": "type", "min_type_rows": 3,
            "leaf_spec": FeatureSpec(SERVE_FEATURES)}


class NoMeasuredStep(ValueError):
    """No step of the training data has a measured energy: the overhead leaf cannot be fit."""


def fit_predictor(ds: TreeDataset) -> TreePredictor:
    """Every leaf on its measurements; then the `overhead` leaf on what each measured step
    leaves after its other leaves' predictions, weighted by 1/root^2 so that it minimizes the
    steps' relative error (the trainer's residual fit of a `self` leaf, for the root's own
    work). Residuals are kept whatever their sign: dropping the negative ones, or weighting
    by the noisy residual itself, would bias the overhead low. Measured remainders exist only
    on the few sampled steps, measured steps on all."""
    nodes = ds.nodes
    is_overhead = (nodes.node_id == OVERHEAD).to_numpy()
    predictor = TreePredictor(**predictor_params()).fit(_with_energy(ds, is_overhead, np.nan))
    pred = predictor.predict(ds).nodes
    pred = pred[pred.level != "self"]
    parents = set(zip(pred.tree_id, pred.parent_id))
    leaf = np.array([(t, n) not in parents for t, n in zip(pred.tree_id, pred.node_id)])
    others = pred[leaf & (pred.node_id != OVERHEAD)].groupby("tree_id").predicted_j.sum()
    roots = nodes[nodes.parent_id == ""].set_index("tree_id").energy_j.dropna()
    rows = nodes[is_overhead & nodes.tree_id.isin(roots.index).to_numpy()]
    if rows.empty:
        raise NoMeasuredStep("no measured step: the overhead leaf has nothing to fit")
    root = roots.reindex(rows.tree_id).to_numpy()
    residual = root - others.reindex(rows.tree_id).to_numpy()
    overhead = predictor._new_leaf().fit(predictor.spec_.matrix(rows), residual,
                                         sample_weight=1.0 / root**2)
    predictor.leaves_[f"module:{OVERHEAD}"] = overhead
    return predictor


def _with_energy(ds: TreeDataset, rows: Any, values: Any) -> TreeDataset:
    nodes = ds.nodes.copy()
    energy = nodes.energy_j.to_numpy(float).copy()
    energy[rows] = values if np.ndim(values) == 0 else np.asarray(values)[rows]
    nodes["energy_j"] = energy
    return TreeDataset(ds.name, nodes, ds.trees, ds.features, ds.issues)


def _covered_method() -> ev.Method:
    """The campaign predictor; a held-out fold with a leaf type no training tree has (a
    collective, when only TP 1 is left to train on), or whose training trees have no measured
    step, is reported missing, not guessed."""
    def run(train: TreeDataset, test: TreeDataset) -> pd.Series:
        try:
            nodes = fit_predictor(train).predict(test).nodes
        except (UncoveredLeaves, NoMeasuredStep):
            return pd.Series(dtype=float)
        return pd.Series(nodes.predicted_j.to_numpy(), index=ev._keys(nodes))
    return ev.Method(ev.MAIN, run, "leaves per node type on serve-path features, summed")


def _measured_per_level(name: str, fit: Callable[[pd.DataFrame], Any],
                        columns: Sequence[str], description: str) -> ev.Method:
    """A baseline fitted per level on that level's measured training nodes."""
    cols = list(columns)

    def fit_predict(_: TreeDataset, tr: pd.DataFrame, te: pd.DataFrame) -> np.ndarray:
        tr = tr[tr.energy_j.notna()]
        if tr.empty:
            return np.full(len(te), np.nan)
        return fit(tr).predict(te[cols].to_numpy(float))
    return ev.per_level(name, fit_predict, description)


def methods() -> list[ev.Method]:
    tokens = ["prefill_tokens", "decode_tokens"]
    return [
        _covered_method(),
        _measured_per_level(
            "tokens", lambda tr: LinearRegression().fit(tr[tokens].to_numpy(float),
                                                        tr.energy_j.to_numpy(float)),
            tokens, "Wilkins et al.: energy linear in prompt and output tokens, per level"),
        _measured_per_level(
            "per_level", lambda tr: EnergyRegressor().fit(tr[list(SERVE_FEATURES)].to_numpy(
                float), tr.energy_j.to_numpy(float)), SERVE_FEATURES,
            "one relative-error regressor per level on the same serve features, no types, "
            "no tree"),
    ]


def evaluate_campaign(ds: TreeDataset, progress: bool = True) -> dict[str, Any]:
    """Each protocol's result JSON (evaluate.result_json), or the reason it cannot run."""
    out: dict[str, Any] = {}
    for protocol in PROTOCOLS:
        try:
            result = ev.evaluate_protocol(ds, methods(), protocol, progress)
        except ev.ProtocolError as exc:
            out[protocol] = {"skipped": str(exc)}
            continue
        # Wait leaves are estimates from the wait distribution (campaign_data), not
        # measurements: trained on, never scored.
        result.predictions = result.predictions[result.predictions.type != "wait"]
        result.notes.append("wait nodes are not scored: their energy is the synchronization-"
                            "sampling estimate (mean wait x collective power), not metered")
        out[protocol] = ev.result_json(result)
        out[protocol]["_predictions"] = result.predictions
    return out


def campaign_interval(data: CampaignData, level: float = conformal.DEFAULT_LEVEL
                      ) -> tuple[dict[str, Any], pd.DataFrame]:
    """The bundle's `serving.interval` (split conformal on the 3-fold out-of-fold residuals of
    the total step energy, coverage split by cell) and the residuals it was fitted on. Raises
    `conformal.ConformalError` when the campaign measured too few steps or cells."""
    steps = conformal.out_of_fold_steps(data, fit_predictor)
    return conformal.interval_section(steps, level, grouped=True), steps


def fit_step_time(ds: TreeDataset) -> Pipeline:
    """The worker's step time (what the serve path multiplies idle power by) from the root's
    serve features, on unsampled steps (a sampled step's time holds its replays)."""
    roots = _clean_roots(ds)
    if len(roots) < len(STEP_TIME_FEATURES) + 1:
        raise ValueError(f"{len(roots)} clean steps: too few to fit a step-time model")
    X = roots[list(STEP_TIME_FEATURES)].to_numpy(float)
    y = roots.worker_s.to_numpy(float)
    model = Pipeline([("scale", StandardScaler()), ("model", LinearRegression())])
    return model.fit(X, y, model__sample_weight=1.0 / y**2)


def _clean_roots(ds: TreeDataset) -> pd.DataFrame:
    """Roots of unsampled steps (sampled ones have no time: `campaign_data`)."""
    n = ds.nodes
    return n[(n.parent_id == "") & n.time_s.notna() & (n.worker_s > 0)]


def serving_section(data: CampaignData, device: tuple[str, str], header: dict[str, Any],
                    step_time: dict[str, Any]) -> dict[str, Any]:
    ds = data.dataset
    trees = ds.trees.assign(config=[g.split("/")[0] for g in ds.trees.group])
    templates = {}
    for config, g in trees.groupby("config"):
        first = g.tree_id.iloc[0]
        templates[config] = template_of(ds.nodes[ds.nodes.tree_id == first])
    static = conformal.static_watts(data)  # the interval's residuals use the same
    sync = data.sync
    return {
        "model": portable_model(header["model"]), "architecture": header["architecture"],
        "dtype_bytes": int(header["shape"]["dtype_bytes"]), "shape": header["shape"],
        "device_type": device[0], "device_name": device[1],
        "meter": str(data.static.meter.iloc[0]),
        "static_watts": {k: float(v) for k, v in static.items()},
        # a host meter (CPU estimate, RAPL) sees the whole host at any TP degree; GPU meters
        # measure each device, so an unmeasured degree scales with the device count
        "static_per_device": device[0] != "cpu",
        "wait_s": {c: dict(zip(g.op, g.mean_s.astype(float))) for c, g in sync.groupby("config")},
        "sync_quantiles": {c: {r.op: {"n": int(r.n), "mean_s": float(r.mean_s), **{
            f"q{int(q * 100):02d}_s": float(getattr(r, f"q{int(q * 100):02d}_s"))
            for q in QUANTILES}} for r in g.itertuples()} for c, g in sync.groupby("config")},
        "templates": templates,
        "step_time": step_time,
        "features_supplied_by_serve_path": list(SERVE_FEATURES),
        "detail_only_features": list(DETAIL_ONLY),
        "static_includes": "idle power x step time; the `overhead` leaf (step work outside "
                           "the modules) is reported under `static` too",
    }


def portable_model(model: str) -> str:
    """How a bundle names the model it was calibrated on. A model directory directly under a
    `.cache/` directory (where scripts/setup.sh and the tests put the tiny model, at the root
    of a checkout) is named from `.cache/` on, as the remake command runs from a checkout:
    the checkout's absolute place is one host's, and would make a shipped manifest differ by
    where it was made. Hub ids, relative paths and other directories (a Hugging Face cache
    snapshot lies deeper than `.cache/NAME`) are kept as given."""
    path = PurePosixPath(model)
    if path.is_absolute() and path.parent.name == ".cache":
        return str(PurePosixPath(".cache", path.name))
    return model


def train_bundle(data: CampaignData, out_dir: Path, *, device: tuple[str, str],
                 header: dict[str, Any], command: str, metrics: dict[str, Any],
                 interval: dict[str, Any] | None = None) -> Path:
    """`interval`: the `serving.interval` of `campaign_interval`; None leaves it out (the
    serve path then states no interval)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.onnx"):  # a remade bundle must not hash stale graphs
        old.unlink()
    ds = data.dataset
    predictor = fit_predictor(ds)
    timer = fit_step_time(ds)
    _sklearn_onnx(timer, len(STEP_TIME_FEATURES), out_dir / "step_time.onnx")
    roots = _clean_roots(ds)
    pred = timer.predict(roots[list(STEP_TIME_FEATURES)].to_numpy(float))
    step_time = {"file": "step_time.onnx", "features": list(STEP_TIME_FEATURES),
                 "target": "the worker's step time (s)",
                 "mape_percent_in_sample": float(np.mean(
                     np.abs(pred - roots.worker_s) / roots.worker_s) * 100),
                 "steps": int(len(roots))}
    serving = serving_section(data, device, header, step_time)
    if interval is not None:
        serving["interval"] = interval
    name = "campaign-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(header["model"]).name)
    # the manifest's `training_data.models` names the model as `serving.model` does
    named = TreeDataset(ds.name, ds.nodes, ds.trees.assign(model=[
        portable_model(str(m)) for m in ds.trees.model]), ds.features, ds.issues)
    return export_bundle(predictor, named, out_dir, hardware=f"{device[0]}: {device[1]}",
                         command=command, metrics=metrics, serve_features=list(SERVE_FEATURES),
                         ground_truth=f"{serving['meter']}, dynamic energy (minus idle "
                         "power) of repeated-sampling windows and step shapes",
                         serving=serving, bundle_name=name)
