"""Fit the prior's GPU powers to published deployments, and validate the prior the engine serves.

`fit_power`: per GPU, the four powers of `devices.PowerFit` by non-negative least squares on
relative error of energy per output token, every term priced by the serve path's formulas on
the steps one engine alternates between (`published.Deployment.engine_steps`: steps that
carry whole prompts and steps that decode alone, weighted by their share), G GPUs per engine:

    J/token = [P_idle G T + busy (P_run + P_occ N / (N + G n_half)) + W_flop FLOPs / peak
               + W_byte bytes / bandwidth + eps_link link bytes] / tokens per step
    busy = min(G T, (FLOPs / peak + bytes / bandwidth + link bytes / link_bw) / eta)

with N the tokens a step computes (a decode's one, a prompt's whole chunk), T the mean step
time and P_idle the profile's idle power. eta and n_half are searched on a grid (`ETA_GRID`,
`N_HALF_GRID`), the powers refitted at each point; they are chosen by the deployments that
decide them: the same model, task and request limit on different GPU counts
(`gpu_count_pairs`), whose ratio of power per GPU the chosen point reproduces best (the squared
log ratio of predicted to measured, averaged over the pairs). Data without such pairs choose
them by the J/token error.

`validate`: prices every deployment with the predictor the engine would load for that model
and GPU name with the default configuration (`predict.loader.load_predictor`, one step graph
run per deployment), and beside it, for each model, the prior refitted without that model
(leave-one-model-out, eta and n_half searched again inside each fold) and three baselines: the
roofline with datasheet assumptions (the previous default), a constant fraction of board power
times the measured time, and Wilkins et al.'s per-token regression (a constant J/token), both
fitted across the other models.
"""

from __future__ import annotations

import hashlib
import itertools
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
# Work-per-GPU bands (the step's work at peak rates over G T, left-closed): how the error moves
# as each GPU's share of the work falls and its GPUs go idle.
WORK_EDGES = (0.0, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, float("inf"))
WORK_LABELS = ("<0.05", "0.05-0.1", "0.1-0.2", "0.2-0.4", "0.4-0.6", "0.6-0.8", ">=0.8")
# The points searched for eta (the share of busy time a GPU runs at its roofline rate) and
# n_half (tokens per GPU in a step at which the occupancy power is half reached).
ETA_GRID = tuple(float(x) for x in np.geomspace(0.01, 0.3, 31))
N_HALF_GRID = (4.0, 8.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0, 256.0)
# Objectives closer than this are a tie; the first point on the grid wins.
_TIE = 1e-12


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


@dataclass(frozen=True)
class Basis:
    """Per deployment (arrays over `deps`), what the fit needs before eta and n_half are
    chosen: one engine's step priced once."""

    gpu_seconds: np.ndarray  # G T of one engine step
    work: np.ndarray  # K: the step's GPU-seconds at peak rates (its steps' mean)
    devices: np.ndarray  # G, GPUs per engine
    flop: np.ndarray  # J/token per watt at the full FLOP rate
    byte: np.ndarray  # J/token per watt at the full bandwidth (memory and link bytes)
    fixed: np.ndarray  # J/token of idle power and the link term
    per_step: np.ndarray  # engine steps per output token, all engines
    watts_per_gpu: np.ndarray  # J/token -> W per GPU: tokens/s over all GPUs
    joules_per_token: np.ndarray  # measured
    # Per step of a deployment (`Deployment.engine_steps`): its deployment's index, its share
    # of the steps, its work K and its tokens N.
    step_of: np.ndarray
    step_share: np.ndarray
    step_work: np.ndarray
    step_tokens: np.ndarray

    def work_per_gpu(self) -> np.ndarray:
        """The step's work at peak rates over G T: the share of time the GPUs would be busy
        at their roofline rates."""
        return self.work / self.gpu_seconds

    def design(self, eta: float, n_half: float) -> np.ndarray:
        """[n, 4] J/token per watt of P_run, P_occ, W_flop and W_byte at (eta, n_half)."""
        of, n = self.step_of, len(self.gpu_seconds)
        busy = self.step_share * np.minimum(self.gpu_seconds[of], self.step_work / eta)
        occupancy = self.step_tokens / (self.step_tokens + self.devices[of] * n_half)
        return np.column_stack([self.per_step * np.bincount(of, busy, n),
                                self.per_step * np.bincount(of, busy * occupancy, n),
                                self.flop, self.byte])


def basis(deps: Sequence[Deployment], spec: DeviceSpec) -> Basis:
    """Every deployment's steps priced once (`step_work`), on one GPU's spec."""
    cols: dict[str, list[float]] = {k: [] for k in Basis.__dataclass_fields__}
    dynamic = spec.tdp_watts - spec.static_watts
    for i, dep in enumerate(deps):
        peak = spec.peak_flops_16bit if dep.shape.dtype_bytes < 4 else spec.peak_flops_fp32
        per_step = dep.engines / dep.batch
        devices = dep.devices / dep.engines
        t_flop = t_byte = k = link = 0.0
        for share, step in dep.engine_steps():
            work = step_work(dep.shape, step)
            flops, mem = float(work.flops.sum()), float(work.mem_bytes.sum())
            step_link = float(work.link_bytes.sum())
            step_flop, step_byte = flops / peak, (mem + 2 * step_link) / spec.mem_bandwidth
            step_k = step_flop + step_byte + step_link / spec.link_bandwidth
            t_flop, t_byte = t_flop + share * step_flop, t_byte + share * step_byte
            k, link = k + share * step_k, link + share * step_link
            cols["step_of"].append(i)
            cols["step_share"].append(share)
            cols["step_work"].append(step_k)
            cols["step_tokens"].append(float(step.array[:, :2].sum()))
        cols["gpu_seconds"].append(devices * dep.step_seconds)
        cols["work"].append(k)
        cols["devices"].append(devices)
        cols["flop"].append(per_step * t_flop)
        cols["byte"].append(per_step * t_byte)
        cols["fixed"].append(per_step * (spec.static_watts * devices * dep.step_seconds
                                         + link * dynamic / 2 / spec.link_bandwidth))
        cols["per_step"].append(per_step)
        cols["watts_per_gpu"].append(dep.tokens_per_s / dep.devices)
        cols["joules_per_token"].append(dep.joules_per_token)
    arrays = {k: np.array(v, dtype=float) for k, v in cols.items()}
    arrays["step_of"] = arrays["step_of"].astype(np.intp)
    return Basis(**arrays)


def terms(dep: Deployment, spec: DeviceSpec, eta: float = ETA, n_half: float = N_HALF) -> Terms:
    """One deployment's `Terms` at (eta, n_half)."""
    b = basis([dep], spec)
    row = b.design(eta, n_half)[0]
    return Terms(busy=float(row[0]), busy_occupancy=float(row[1]), flop=float(row[2]),
                 byte=float(row[3]), fixed=float(b.fixed[0]))


@dataclass(frozen=True)
class GpuCountPair:
    """Deployments of one model and task with the same request limit on two GPU counts: their
    ratio of power per GPU is what eta decides (a GPU's share of the work falls as GPUs are
    added; how far its power follows is the busy fraction)."""

    model: str
    task: str
    max_batch: float
    fewer: int  # GPUs of the deployment with fewer
    more: int
    fewer_rows: tuple[int, ...]  # indices into the deployments (one, or repeats averaged)
    more_rows: tuple[int, ...]


def gpu_count_pairs(deps: Sequence[Deployment]) -> list[GpuCountPair]:
    """Each model, task and request limit published on several GPU counts gives one pair per
    consecutive two counts; rows without a published limit give none."""
    groups: dict[tuple[str, str, float], dict[int, list[int]]] = {}
    for i, d in enumerate(deps):
        if d.max_batch > 0:
            groups.setdefault((d.model, d.task, d.max_batch), {}).setdefault(
                d.devices, []).append(i)
    out = []
    for (model, task, limit), by_count in sorted(groups.items()):
        counts = sorted(by_count)
        for lo, hi in itertools.pairwise(counts):
            out.append(GpuCountPair(model, task, limit, lo, hi, tuple(by_count[lo]),
                                    tuple(by_count[hi])))
    return out


def pair_ratios(pairs: Sequence[GpuCountPair], watts: np.ndarray) -> np.ndarray:
    """Each pair's power per GPU on more GPUs over that on fewer (`watts`: per deployment)."""
    return np.array([watts[list(p.more_rows)].mean() / watts[list(p.fewer_rows)].mean()
                     for p in pairs])


@dataclass(frozen=True)
class _Point:
    eta: float
    n_half: float
    coef: np.ndarray  # P_run, P_occ, W_flop, W_byte
    objective: float


def _powers(b: Basis, eta: float, n_half: float) -> np.ndarray:
    y = b.joules_per_token
    coef, _ = nnls(b.design(eta, n_half) / y[:, None], 1.0 - b.fixed / y)
    return coef


def _predicted(b: Basis, point: _Point) -> np.ndarray:
    return b.design(point.eta, point.n_half) @ point.coef + b.fixed


def _search(b: Basis, pairs: Sequence[GpuCountPair], etas: Sequence[float],
            n_halves: Sequence[float]) -> _Point:
    """The grid point whose refitted powers reproduce the pairs' ratios best (the J/token
    error where there are no pairs)."""
    measured = pair_ratios(pairs, b.joules_per_token * b.watts_per_gpu) if pairs else None
    best: _Point | None = None
    for eta in etas:
        for n_half in n_halves:
            coef = _powers(b, eta, n_half)
            point = _Point(eta, n_half, coef, 0.0)
            pred = _predicted(b, point)
            if measured is not None:
                ratio = pair_ratios(pairs, pred * b.watts_per_gpu)
                objective = float(np.mean(np.log(ratio / measured) ** 2))
            else:
                objective = float(np.mean((pred / b.joules_per_token - 1.0) ** 2))
            if best is None or objective < best.objective - _TIE:
                best = _Point(eta, n_half, coef, objective)
    assert best is not None
    return best


def fit_power(deps: Sequence[Deployment], source: str, eta: float | None = None,
              n_half: float | None = None) -> PowerFit:
    """The powers that minimise the squared relative error of J/token over `deps` (one GPU),
    at eta and n_half chosen by the GPU-count pairs (module docstring) unless given."""
    gpus = {d.gpu for d in deps}
    if len(gpus) != 1:
        raise FitError(f"fit one GPU at a time, got {sorted(gpus)}")
    if len(deps) < 4:
        raise FitError(f"{len(deps)} configurations: at least 4 are needed to fit 4 powers")
    spec = spec_of(next(iter(gpus)))
    point = _search(basis(deps, spec), gpu_count_pairs(deps),
                    ETA_GRID if eta is None else (eta,),
                    N_HALF_GRID if n_half is None else (n_half,))
    coef = point.coef
    return PowerFit(run_watts=float(coef[0]), occupancy_watts=float(coef[1]),
                    flop_watts=float(coef[2]), byte_watts=float(coef[3]), source=source,
                    eta=point.eta, n_half=point.n_half)


def pair_table(deps: Sequence[Deployment], fit: PowerFit) -> pd.DataFrame:
    """One row per GPU-count pair: measured and predicted ratio of power per GPU, and the
    prediction's error in percent."""
    pairs = gpu_count_pairs(deps)
    if not pairs:
        return pd.DataFrame(columns=["model", "task", "max_batch", "gpus", "measured",
                                     "predicted", "error_pct"])
    b = basis(deps, spec_of(deps[0].gpu))
    coef = np.array([fit.run_watts, fit.occupancy_watts, fit.flop_watts, fit.byte_watts])
    pred = _predicted(b, _Point(fit.eta, fit.n_half, coef, 0.0))
    measured = pair_ratios(pairs, b.joules_per_token * b.watts_per_gpu)
    predicted = pair_ratios(pairs, pred * b.watts_per_gpu)
    return pd.DataFrame({"model": [p.model for p in pairs], "task": [p.task for p in pairs],
                         "max_batch": [p.max_batch for p in pairs],
                         "gpus": [f"{p.fewer}->{p.more}" for p in pairs],
                         "measured": measured, "predicted": predicted,
                         "error_pct": 100 * (predicted / measured - 1)})


def pair_summary(table: pd.DataFrame, within: float = 10.0) -> dict[str, float]:
    """Median and worst error of a `pair_table`, and how many pairs lie beyond +-`within` %."""
    err = table.error_pct
    return {"pairs": len(table), "median_error_pct": float(err.median()),
            "worst_error_pct": float(err.abs().max()),
            "beyond": int((err.abs() > within).sum()), "within_pct": within}


def predicted_joules_per_token(dep: Deployment, predictor: object) -> float:
    """One engine's steps through the predictor's step graph, weighted by their share, times
    engines, per token: what the engine would charge."""
    graph = predictor.graph  # type: ignore[attr-defined]
    joules = sum(share * float(graph.run_batch(step, dep.step_seconds)[1].sum())
                 for share, step in dep.engine_steps())
    return joules * dep.engines / dep.batch


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
    table["work_per_gpu"] = np.concatenate([
        basis([d], spec_of(d.gpu)).work_per_gpu() for d in deps])
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


def work_band(work_per_gpu: pd.Series) -> pd.Series:
    """Each configuration's work-per-GPU band (`WORK_LABELS`)."""
    return pd.cut(work_per_gpu, list(WORK_EDGES), labels=list(WORK_LABELS), right=False)


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
