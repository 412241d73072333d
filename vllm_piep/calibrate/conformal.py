"""Split-conformal prediction intervals for a calibrated bundle's step energy.

What is calibrated is the error of the serve path's *total* step energy: the bundle's leaf
predictions (each clipped at 0, summed) plus the configuration's idle power times the worker's
step time (`predict.served.BundlePredictor.predict_step`), against what the meter saw over the
step: its dynamic energy plus idle power over the step's own duration. Each measured step is
predicted by a predictor fitted without its fold (the evaluation's 3-fold split over steps,
`evaluate.folds`), and its relative residual r = measured / predicted - 1 is kept. An interval
[1 + q_lo, 1 + q_hi] of these residuals is a pair of multipliers of any predicted energy.

Only unsampled steps are scored: a sampled step's worker time holds its replays, which the
serve path never sees, and its measured energy is its shape's power times the shape's median
time (`campaign_data`), not its own.

The interval is for one step. A request spans many steps: if their errors were independent,
its interval would be narrower; errors shared by the steps of one workload (a bias per batch
size or length, which the grouped coverage below exposes) do not average out.

No vLLM import: this runs wherever the calibration does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from vllm_piep.calibrate import evaluate as ev
from vllm_piep.predict.treeeval import UncoveredLeaves

if TYPE_CHECKING:
    from vllm_piep.calibrate.campaign_data import CampaignData
    from vllm_piep.calibrate.train import TreePredictor
    from vllm_piep.datasets.model import TreeDataset

DEFAULT_LEVEL = 0.9
REPEATS = 200
TEST_FRACTION = 0.5
# (n + 1)(1 - a) is an integer for the usual levels and sizes (20 * 0.95 = 19), but in floats
# it can land a hair above it and the ceiling would ask for one more residual than exists.
_EPS = 1e-9
METHOD = ("split conformal, equal-tailed: order statistics ceil((n+1)(1-a)) of the out-of-fold "
          "(3-fold over steps) residuals metered/predicted - 1 of total step energy (leaves + "
          "idle power x step time), a = (1 - level) / 2 per side; widened to contain 1")


class ConformalError(ValueError):
    """Too few residuals (or groups) for the interval or its coverage at this level."""


def tail(level: float) -> float:
    """The miscoverage allowed on each side, a = (1 - level) / 2."""
    if not 0.0 < level < 1.0:
        raise ConformalError(f"level {level!r}: a prediction interval's level is in (0, 1)")
    return (1.0 - level) / 2.0


def min_residuals(level: float) -> int:
    """The fewest residuals for which both conformal ranks exist: ceil((n+1)(1-a)) <= n, that
    is n >= (1 - a) / a (19 at level 0.9)."""
    a = tail(level)
    return max(1, math.ceil((1.0 - a) / a - _EPS))


def conformal_ranks(n: int, level: float) -> tuple[int, int]:
    """The 1-based order statistics (lower, upper) that bound an equal-tailed split-conformal
    interval of n calibration residuals.

    With n exchangeable residuals and one new one, the new one's rank among the n + 1 is
    uniform, so P(r_new <= r_(k)) = k / (n + 1) for continuous residuals. The smallest k with
    k / (n + 1) >= 1 - a is ceil((n + 1)(1 - a)); the plain empirical quantile (k = ceil(n(1-a)),
    i.e. level k/n) covers only k / (n + 1) < 1 - a, short by up to 1 / (n + 1), which is what
    the "+1" corrects. The lower end mirrors it (the k-th largest, rank n + 1 - k), so each
    side misses at most a and the interval covers at least 1 - 2a = level, and, without ties,
    at most level + 2 / (n + 1)."""
    need = min_residuals(level)
    if n < need:
        raise ConformalError(f"{n} residuals are too few for a {level:g} interval: the "
                             f"finite-sample conformal rank needs at least {need}")
    k = math.ceil((n + 1) * (1.0 - tail(level)) - _EPS)
    return n + 1 - k, k


@dataclass(frozen=True)
class Interval:
    """Multipliers of a predicted energy: [lower, upper] holds the measured energy with
    probability `level` (exchangeable steps)."""

    level: float
    q_lo: float
    q_hi: float
    n: int

    # Widened to contain 1: a biased predictor's residuals can all have one sign, but the
    # point prediction should lie inside its own interval; widening never lowers coverage.
    @property
    def lower(self) -> float:
        return min(1.0 + self.q_lo, 1.0)

    @property
    def upper(self) -> float:
        return max(1.0 + self.q_hi, 1.0)

    def covers(self, residuals: Sequence[float] | np.ndarray) -> np.ndarray:
        m = 1.0 + np.asarray(residuals, dtype=float)
        return (m >= self.lower) & (m <= self.upper)


def _finite(residuals: Sequence[float] | np.ndarray | pd.Series) -> np.ndarray:
    r = np.asarray(residuals, dtype=float)
    if not np.isfinite(r).all():
        raise ConformalError(f"{int((~np.isfinite(r)).sum())} residuals are not finite")
    return r


def split_conformal(residuals: Sequence[float] | np.ndarray | pd.Series,
                    level: float = DEFAULT_LEVEL) -> Interval:
    """The interval of `conformal_ranks` on these calibration residuals."""
    r = np.sort(_finite(residuals))
    lo, hi = conformal_ranks(len(r), level)
    return Interval(level, float(r[lo - 1]), float(r[hi - 1]), len(r))


@dataclass(frozen=True)
class Coverage:
    """Fraction of a held-out part inside the interval fitted on the rest, over repeats."""

    mean: float
    p05: float
    p95: float
    repeats: int
    test_fraction: float
    grouped_by: str | None
    units: int  # groups (or residuals, ungrouped) that the splits deal out
    distinct_splits: int  # how many different splits exist: few groups, many repeats

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "p05": self.p05, "p95": self.p95, "repeats": self.repeats,
                "test_fraction": self.test_fraction, "grouped_by": self.grouped_by}


def split_coverage(residuals: Sequence[float] | np.ndarray | pd.Series,
                   level: float = DEFAULT_LEVEL, *,
                   groups: Sequence[Any] | np.ndarray | pd.Series | None = None,
                   group_name: str = "cell", repeats: int = REPEATS,
                   test_fraction: float = TEST_FRACTION, seed: int = 0) -> Coverage:
    """Repeatedly split the residuals into a calibration part and a test part (whole groups
    at a time when `groups` is given, so that steps of one cell are never on both sides and
    their shared error cannot flatter the coverage), fit `split_conformal` on the calibration
    part and measure the fraction of the test part inside. A split whose calibration part is
    too small for the level (possible with groups of unequal size) is drawn again; at most
    `repeats` redraws are made beyond `repeats`."""
    r = _finite(residuals)
    if groups is None:
        units = np.arange(len(r))
    else:
        if len(groups) != len(r):
            raise ConformalError(f"{len(groups)} group labels for {len(r)} residuals")
        units = pd.factorize(pd.Series(list(groups)))[0]
    n_units = int(units.max()) + 1 if len(units) else 0
    if n_units < 2:
        raise ConformalError(f"{n_units} {group_name if groups is not None else 'residual'}"
                             "(s): a split needs at least two")
    if not 0.0 < test_fraction < 1.0:
        raise ConformalError(f"test fraction {test_fraction!r} is not in (0, 1)")
    n_test = min(max(round(n_units * test_fraction), 1), n_units - 1)
    need = min_residuals(level)
    if groups is None and len(r) - n_test < need:
        raise ConformalError(
            f"{len(r)} residuals: a calibration part of {len(r) - n_test} is too few for a "
            f"{level:g} interval (needs {need}, so about {math.ceil(need / (1 - test_fraction))}"
            " residuals in all)")
    rng = np.random.default_rng(seed)
    fractions: list[float] = []
    for _ in range(2 * repeats):
        if len(fractions) == repeats:
            break
        test = np.isin(units, rng.permutation(n_units)[:n_test])
        if (~test).sum() < need:
            continue
        fractions.append(float(split_conformal(r[~test], level).covers(r[test]).mean()))
    if not fractions:
        raise ConformalError(f"no split of {n_units} {group_name}s left {need} residuals to "
                             f"calibrate a {level:g} interval on: measure more steps")
    f = np.asarray(fractions)
    return Coverage(float(f.mean()), float(np.percentile(f, 5)), float(np.percentile(f, 95)),
                    len(f), float(test_fraction), group_name if groups is not None else None,
                    n_units, math.comb(n_units, n_test))


# --------------------------------------------------------------------------- the campaign
def static_watts(data: CampaignData) -> pd.Series:
    """Idle power per configuration as the bundle states it (mean over attempts)."""
    return data.static.groupby("config").idle_watts.mean()


def dynamic_step_joules(predictor: TreePredictor, ds: TreeDataset) -> pd.Series:
    """Per tree: the sum of its leaves' predictions, each clipped at 0 (the serve path's
    dynamic energy, `BundlePredictor.leaf_joules`)."""
    nodes = predictor.predict(ds).nodes
    nodes = nodes[nodes.level != "self"]
    parents = set(zip(nodes.tree_id, nodes.parent_id))
    leaf = np.array([(t, n) not in parents for t, n in zip(nodes.tree_id, nodes.node_id)],
                    dtype=bool)
    joules = np.maximum(nodes.predicted_j.to_numpy(float), 0.0)
    return pd.Series(joules[leaf], index=nodes.tree_id.to_numpy()[leaf]).groupby(level=0).sum()


def measured_steps(data: CampaignData) -> pd.DataFrame:
    """Unsampled steps with a measured energy: their cell, configuration, times, and total
    measured energy (dynamic + idle power over the step's own duration, `time_s`: the meter's
    energy over the step). With several attempts of one configuration, idle power is their
    mean, as the bundle states it."""
    ds = data.dataset
    n = ds.nodes
    roots = n[(n.parent_id == "") & n.energy_j.notna() & n.time_s.notna()
              & (n.worker_s > 0)]
    group = ds.trees.set_index("tree_id").group.reindex(roots.tree_id).to_numpy()
    config = np.array([str(g).split("/")[0] for g in group])
    idle = static_watts(data)
    missing = sorted(set(config) - set(idle.index))
    if missing:
        raise ConformalError(f"no idle power measured for configuration(s) {missing}")
    watts = idle.reindex(config).to_numpy(float)
    time_s = roots.time_s.to_numpy(float)
    return pd.DataFrame({
        "tree_id": roots.tree_id.to_numpy(), "cell": group, "config": config,
        "time_s": time_s, "worker_s": roots.worker_s.to_numpy(float),
        "static_watts": watts,
        "measured_j": roots.energy_j.to_numpy(float) + watts * time_s})


def out_of_fold_steps(data: CampaignData, fit: Callable[[TreeDataset], TreePredictor],
                      k: int = 3, seed: int = 0) -> pd.DataFrame:
    """`measured_steps` with each step's out-of-fold prediction and relative residual: the
    steps of each fold of `evaluate.folds(ds, "kfold", k, seed)` (the evaluation's split) are
    predicted by `fit` on the other folds."""
    ds = data.dataset
    fold = ev.folds(ds, "kfold", k, seed)
    dynamic = []
    for name in sorted(fold.unique()):
        test = ds.subset(fold.index[fold == name])
        test.nodes = test.nodes.assign(energy_j=np.nan)  # nothing held out reaches a fit
        try:
            dynamic.append(dynamic_step_joules(fit(ds.subset(fold.index[fold != name])), test))
        except UncoveredLeaves as exc:
            raise ConformalError(f"{name}: its steps have a leaf type no other fold has, so "
                                 f"they cannot be predicted out of fold ({exc})") from exc
    steps = measured_steps(data)
    steps["fold"] = fold.reindex(steps.tree_id).to_numpy()
    steps["dynamic_pred_j"] = pd.concat(dynamic).reindex(steps.tree_id).to_numpy(float)
    steps["predicted_j"] = steps.dynamic_pred_j + steps.static_watts * steps.worker_s
    steps["residual"] = steps.measured_j / steps.predicted_j - 1.0
    return steps


def interval_section(steps: pd.DataFrame, level: float = DEFAULT_LEVEL, *,
                     grouped: bool = True, repeats: int = REPEATS,
                     test_fraction: float = TEST_FRACTION, seed: int = 0) -> dict[str, Any]:
    """The manifest's `serving.interval`: the multipliers fitted on every residual of
    `out_of_fold_steps`, and their coverage by `split_coverage` (split by cell if
    `grouped`)."""
    interval = split_conformal(steps.residual, level)
    coverage = split_coverage(steps.residual, level, groups=steps.cell if grouped else None,
                              repeats=repeats, test_fraction=test_fraction, seed=seed)
    return {"level": float(level), "lower": interval.lower, "upper": interval.upper,
            "method": METHOD, "residuals": interval.n, "coverage": coverage.as_dict()}


__all__ = ["ConformalError", "Coverage", "Interval", "conformal_ranks", "interval_section",
           "min_residuals", "out_of_fold_steps", "split_conformal", "split_coverage"]
