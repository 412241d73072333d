"""Fit the prior's GPU powers to published deployments, and validate the prior the engine serves.

`fit_power`: per GPU, the four powers of `devices.PowerFit` by non-negative least squares on
relative error of energy per output token, every term priced by the serve path's formulas on
the deployment's average step (`published.Deployment.engine_step`), G GPUs per engine:

    J/token = [P_idle G T + busy (P_run + P_occ N / (N + G n_half)) + W_flop FLOPs / peak
               + W_byte bytes / bandwidth + eps_link link bytes] / tokens per step
    busy = min(G T, (FLOPs / peak + bytes / bandwidth + link bytes / link_bw) / eta)

with P_idle the profile's idle power and eta, n_half chosen (`devices.ETA`, `devices.N_HALF`).

`validate`: prices every deployment with the predictor the engine would load for that model
and GPU name with the default configuration (`predict.loader.load_predictor`, one step graph
run per deployment), and beside it, for each model, the prior refitted without that model
(leave-one-model-out) and three baselines: the roofline with datasheet assumptions (the
previous default), a constant fraction of board power times the measured time, and Wilkins et
al.'s per-token regression (a constant J/token), both fitted across the other models.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from vllm_piep.calibrate.errors import FitError
from vllm_piep.calibrate.published import Deployment
from vllm_piep.model.devices import (
    ETA,
    GPU_SPECS,
    N_HALF,
    DeviceProfile,
    DeviceSpec,
    PowerFit,
    gpu_profile_key,
)
from vllm_piep.model.flops import step_work

METHODS = ("served", "lomo", "roofline", "tdp_fraction", "wilkins")
WITHIN = 20.0  # percent: the share of configurations within this error is reported
# Batch-size bands (requests per engine step, left-closed): how the error follows load.
BAND_EDGES = (0, 12, 24, 48, 80, 160, 320, 640, float("inf"))
BAND_LABELS = ("~8", "~16", "~32", "~64", "96-128", "192-256", "384-512", "640+")


def spec_of(gpu: str) -> DeviceSpec:
    key = gpu_profile_key(gpu)
    if key is None:
        raise FitError(f"GPU {gpu!r} has no datasheet profile")
    return GPU_SPECS[key]


@dataclass(frozen=True)
class Terms:
    """A deployment's J/token per watt of each fitted power (busy GPU-seconds, the same times
    occupancy, GPU-seconds at the full FLOP rate and at full bandwidth), and the fixed part:
    idle power times the GPUs' time, and the link term."""

    busy: float
    busy_occupancy: float
    flop: float
    byte: float
    fixed: float


def terms(dep: Deployment, spec: DeviceSpec) -> Terms:
    eta, n_half = ETA, N_HALF
    step = dep.engine_step()
    work = step_work(dep.shape, step)
    flops, mem = float(work.flops.sum()), float(work.mem_bytes.sum())
    link = float(work.link_bytes.sum())
    peak = spec.peak_flops_16bit if dep.shape.dtype_bytes < 4 else spec.peak_flops_fp32
    per_step = dep.engines / dep.batch  # engine steps per output token, all engines
    devices = dep.devices / dep.engines  # GPUs per engine
    dynamic = spec.tdp_watts - spec.static_watts
    t_flop = flops / peak
    t_byte = (mem + 2 * link) / spec.mem_bandwidth
    busy = min(devices * dep.step_seconds, (t_flop + t_byte + link / spec.link_bandwidth) / eta)
    requests = float(len(step.array))
    occupancy = requests / (requests + devices * n_half)
    return Terms(busy=per_step * busy, busy_occupancy=per_step * busy * occupancy,
                 flop=per_step * t_flop, byte=per_step * t_byte,
                 fixed=per_step * (spec.static_watts * devices * dep.step_seconds
                                   + link * dynamic / 2 / spec.link_bandwidth))


def fit_power(deps: Sequence[Deployment], source: str) -> PowerFit:
    """The powers that minimise the squared relative error of J/token over `deps` (one GPU)."""
    gpus = {d.gpu for d in deps}
    if len(gpus) != 1:
        raise FitError(f"fit one GPU at a time, got {sorted(gpus)}")
    if len(deps) < 4:
        raise FitError(f"{len(deps)} configurations: at least 4 are needed to fit 4 powers")
    spec = spec_of(next(iter(gpus)))
    t = [terms(d, spec) for d in deps]
    y = np.array([d.joules_per_token for d in deps])
    a = np.array([[x.busy, x.busy_occupancy, x.flop, x.byte] for x in t]) / y[:, None]
    b = 1.0 - np.array([x.fixed for x in t]) / y
    coef, _ = nnls(a, b)
    return PowerFit(run_watts=float(coef[0]), occupancy_watts=float(coef[1]),
                    flop_watts=float(coef[2]), byte_watts=float(coef[3]), source=source,
                    eta=ETA, n_half=N_HALF)


def predicted_joules_per_token(dep: Deployment, predictor: object) -> float:
    """One engine's average step through the predictor's step graph, times engines, per
    token: what the engine would charge."""
    _, joules = predictor.graph.run_batch(dep.engine_step(), dep.step_seconds)  # type: ignore[attr-defined]
    return float(joules.sum()) * dep.engines / dep.batch


def served_predictor(dep: Deployment) -> object:
    """The predictor the engine loads for this model and GPU with the default configuration."""
    from vllm_piep.config import PiepConfig
    from vllm_piep.predict.loader import load_predictor

    return load_predictor(PiepConfig(bundle=None), dep.shape, "cuda", dep.gpu)


def prior_with(dep: Deployment, fit: PowerFit | None) -> object:
    from vllm_piep.predict.prior import PriorPredictor

    spec = spec_of(dep.gpu)
    return PriorPredictor(dep.shape, DeviceProfile.from_spec(spec, dep.shape.dtype_bytes,
                                                             fitted=False, fit=fit))


def _relative_fit(x: np.ndarray, y: np.ndarray) -> float:
    """The c minimising sum((c x - y) / y)^2."""
    r = x / y
    return float(r.sum() / (r * r).sum())


def _lomo(deps: Sequence[Deployment], fit_predict: Callable[[list[Deployment], Deployment], float],
          progress: bool) -> list[float]:
    from tqdm import tqdm

    models = sorted({d.model for d in deps})
    out = {}
    for model in tqdm(models, desc="leave-one-model-out", disable=not progress, leave=False):
        train = [d for d in deps if d.model != model]
        for d in deps:
            if d.model == model:
                out[d.line] = fit_predict(train, d)
    return [out[d.line] for d in deps]


def validate(deps: Sequence[Deployment], progress: bool = True) -> pd.DataFrame:
    """One row per deployment: measured and each method's predicted J/token."""
    rows = []
    for d in deps:
        served = served_predictor(d)  # one step-graph session per deployment
        rows.append({"model": d.model, "task": d.task, "gpu": d.gpu, "architecture": d.kind,
                     "line": d.line, "tp": d.shape.tp, "ep": d.shape.ep, "engines": d.engines,
                     "batch": d.batch, "measured_j_per_token": d.joules_per_token,
                     "served_bundle": served.bundle_id,  # type: ignore[attr-defined]
                     "served": predicted_joules_per_token(d, served)})
    table = pd.DataFrame(rows)
    fits: dict[tuple[str, ...], PowerFit] = {}

    def lomo(train: list[Deployment], d: Deployment) -> float:
        same = [t for t in train if t.gpu == d.gpu]
        key = tuple(sorted({t.model for t in same}))
        if key not in fits:
            fits[key] = fit_power(same, "leave-one-model-out")
        return predicted_joules_per_token(d, prior_with(d, fits[key]))

    table["lomo"] = _lomo(deps, lomo, progress)
    table["roofline"] = [predicted_joules_per_token(d, prior_with(d, None)) for d in deps]

    def tdp_fraction(train: list[Deployment], d: Deployment) -> float:
        same = [t for t in train if t.gpu == d.gpu]
        x = np.array([spec_of(t.gpu).tdp_watts * t.devices * t.step_seconds / t.batch
                      for t in same])
        c = _relative_fit(x, np.array([t.joules_per_token for t in same]))
        return c * spec_of(d.gpu).tdp_watts * d.devices * d.step_seconds / d.batch

    def wilkins(train: list[Deployment], d: Deployment) -> float:
        same = [t for t in train if t.gpu == d.gpu]
        y = np.array([t.joules_per_token for t in same])
        return _relative_fit(np.ones_like(y), y)

    table["tdp_fraction"] = _lomo(deps, tdp_fraction, progress)
    table["wilkins"] = _lomo(deps, wilkins, progress)
    return table


def batch_band(batch: pd.Series) -> pd.Series:
    """Each configuration's batch-size band (`BAND_LABELS`)."""
    return pd.cut(batch, list(BAND_EDGES), labels=list(BAND_LABELS), right=False)


def constants(spec: DeviceSpec, fit: PowerFit, dtype_bytes: int = 2) -> dict[str, float]:
    """A power fit in physical units on `spec`: idle, busy and occupancy W per GPU, pJ per FLOP
    at the dtype's peak, per byte of memory traffic and per byte over the link."""
    profile = DeviceProfile.from_spec(spec, dtype_bytes, fit=fit)
    return {"idle_w": spec.static_watts, "run_w": fit.run_watts,
            "occupancy_w": fit.occupancy_watts, "eta": fit.eta, "n_half": fit.n_half,
            "pj_per_flop": profile.joules_per_flop * 1e12,
            "pj_per_byte": profile.joules_per_byte * 1e12,
            "pj_per_link_byte": profile.joules_per_link_byte * 1e12}


def summary(table: pd.DataFrame, by: Sequence[str] = ()) -> pd.DataFrame:
    """Coverage, MAPE, median signed error and share within +-20 % per method (and group)."""
    rows = []
    groups = table.groupby(list(by), observed=True) if by else [((), table)]
    for key, g in groups:
        key = key if isinstance(key, tuple) else (key,)
        for method in METHODS:
            err = 100 * (g[method] - g.measured_j_per_token) / g.measured_j_per_token
            ok = err[np.isfinite(err)]
            rows.append({**dict(zip(by, key)), "method": method, "n": len(ok),
                         "mape": float(ok.abs().mean()), "median_signed": float(ok.median()),
                         "within_20": float(100 * (ok.abs() <= WITHIN).mean())})
    return pd.DataFrame(rows)


def plot(table: pd.DataFrame, path: Path, title: str) -> Path:
    """Predicted (served prior and leave-one-model-out) against measured J/token, log axes,
    one colour per architecture, the +-20 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5), sharex=True, sharey=True)
    lo = float(table[["measured_j_per_token", "served", "lomo"]].min().min()) * 0.7
    hi = float(table[["measured_j_per_token", "served", "lomo"]].max().max()) * 1.4
    line = np.geomspace(lo, hi, 50)
    for ax, method, label in ((axes[0], "served", "served prior (fitted on all)"),
                              (axes[1], "lomo", "leave-one-model-out")):
        for kind, g in table.groupby("architecture"):
            ax.scatter(g.measured_j_per_token, g[method], s=14, alpha=0.75, label=kind)
        ax.plot(line, line, "k-", lw=0.8, label="predicted = measured")
        ax.fill_between(line, line * 0.8, line * 1.2, color="grey", alpha=0.15, label="±20 %")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured J per output token")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.2)
    axes[0].set_ylabel("predicted J per output token")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def write_fits(fits: dict[str, dict[str, object]], out: Path) -> Path:
    out.write_text(json.dumps({"fits": fits}, indent=2) + "\n")
    return out
