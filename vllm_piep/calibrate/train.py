"""The multi-level energy regressor: IrEne (§4.1, Eq. 1-5) with PIE-P's model level (Eq. 3).

- Leaves: `EnergyRegressor` (IrEne Eq. 1), one per node type where that beats the regressor its
  level shares (chosen by leave-one-model-out inside the training split), else the shared one;
  a `self` leaf under every inner node carries the node's work outside its measured children,
  fitted end to end on the parents' relative error (Eq. 4).
- Inner nodes: the sum of their children, or `TreeCombiner`'s weighted sum, alpha(c) = 1 +
  tanh(W.feat(c) + b) / tau with one (W, b) for all inner nodes (Eq. 3), trained end to end on
  the relative squared error summed over every subtree (Eq. 4), or step-wise from measured
  children (the StepWise ablation, Eq. 5).
- Model level: `ModelLevelRegressor`, PIE-P Eq. 3: model energy regressed on the module-level
  energies by component (attention, MLP, ..., communication) that the tree predicts.

`TreePredictor` ties them together; `predict` returns every node's prediction so that each
level can be scored and the tree stays consistent (a parent is the alpha-weighted sum of its
children). Everything here exports to ONNX (`calibrate.export`); nothing needs vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import minimize
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.linear_model import LinearRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.validation import check_is_fitted

from vllm_piep.datasets.features import RESOURCE
from vllm_piep.datasets.model import TreeDataset
from vllm_piep.predict.featurespec import FeatureSpec
from vllm_piep.predict.treeeval import (
    LEVEL_FLAGS,
    MODEL_COMPONENTS,
    SELF,
    TreeIndex,
    check_leaf_coverage,
    choose_leaf_key,
    component_matrix,
    leaf_keys,
    prepare_nodes,
)

log = logging.getLogger(__name__)

# Features that add up over a node's children (a `self` node gets the remainder).
EXTENSIVE: tuple[str, ...] = ("time_s", "device_energy_j", "gflop", "mem_mib")


def energy_terms(features: Sequence[str], nodes: pd.DataFrame | None = None) -> FeatureSpec:
    """Leaf features as energy-like terms: device energy, time, and each resource level times
    time. Energy is power x time, and a linear model of power in the resource levels becomes a
    linear model of energy in these products; with no intercept, zero time costs zero energy.
    With `nodes`, only features present (not NaN) on every node are used."""
    have = set(features)
    if nodes is not None:
        have = {f for f in have if f in nodes and nodes[f].notna().all()}
    cols = [c for c in ("device_energy_j", "time_s") if c in have]
    if "time_s" in have:
        cols += [f"{r}*time_s" for r in RESOURCE if r in have]
    return FeatureSpec(tuple(cols))


class EnergyRegressor(RegressorMixin, BaseEstimator):
    """Energy of a node from its feature matrix (IrEne Eq. 1).

    kind: "linear" (IrEne) or "gbr" (gradient boosting). relative: weight each row by 1/y^2,
    so the fit minimizes relative squared error, the quantity MAPE scores, rather than letting
    the largest nodes dominate. target "log" fits log(y) (log-linear models). Features are
    scaled to unit variance on the training rows only; they are centred only with an
    intercept, because centring puts an intercept back into a through-origin model.

    exposure: with target "log", the index of a column of X holding a duration the energy is
    proportional to (device-seconds): the fit is then of log(y / exposure), i.e. of the log
    of the mean power, and that column is not a regression input.
    """

    def __init__(self, kind: str = "linear", relative: bool = True, fit_intercept: bool = False,
                 target: str = "linear", exposure: int | None = None) -> None:
        self.kind = kind
        self.relative = relative
        self.fit_intercept = fit_intercept
        self.target = target
        self.exposure = exposure

    def _split(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.exposure is None:
            return X, np.ones(len(X))
        keep = [j for j in range(X.shape[1]) if j != self.exposure]
        # exposure alone: a constant mean power (one zero column keeps sklearn's shapes)
        inputs = X[:, keep] if keep else np.zeros((len(X), 1))
        return inputs, X[:, self.exposure]

    def fit(self, X: np.ndarray, y: np.ndarray,
            sample_weight: np.ndarray | None = None) -> EnergyRegressor:
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        if self.kind not in ("linear", "gbr") or self.target not in ("linear", "log"):
            raise ValueError(f"unknown kind {self.kind!r} or target {self.target!r}")
        if self.exposure is not None and self.target != "log":
            raise ValueError("exposure needs target='log'")
        if sample_weight is None and self.relative and self.target == "linear":
            sample_weight = 1.0 / np.maximum(np.abs(y), 1e-300) ** 2
        self.n_features_in_ = X.shape[1]  # exposure column included
        X, exposure = self._split(X)
        z = np.log(y / exposure) if self.target == "log" else y
        if self.kind == "linear":
            model = LinearRegression(fit_intercept=self.fit_intercept)
        else:
            model = GradientBoostingRegressor(n_estimators=200, max_depth=3, learning_rate=0.05,
                                              random_state=0)
        self.pipeline_ = Pipeline([("scale", StandardScaler(with_mean=self.fit_intercept)),
                                   ("model", model)])
        self.pipeline_.fit(X, z, model__sample_weight=sample_weight)
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        check_is_fitted(self, "pipeline_")
        X, exposure = self._split(np.asarray(X, dtype=np.float64))
        z = self.pipeline_.predict(X)
        return np.exp(z) * exposure if self.target == "log" else z


@dataclass
class NodeBatch:
    """Prepared nodes of a set of trees with their tree index and feature matrices."""

    nodes: pd.DataFrame
    index: TreeIndex
    measured: np.ndarray  # float64 energy, NaN where not measured
    models: np.ndarray    # each node's model (for leave-one-model-out inside training)

    @classmethod
    def build(cls, ds: TreeDataset, spec: FeatureSpec, self_nodes: bool) -> NodeBatch:
        extensive = [*EXTENSIVE, *spec.products()]
        nodes = prepare_nodes(ds.nodes, spec.products(), extensive, self_nodes)
        index = TreeIndex.build(nodes.tree_id.tolist(), nodes.node_id.tolist(),
                                nodes.parent_id.tolist())
        model_of = dict(zip(ds.trees.tree_id, ds.trees.model))
        return cls(nodes, index, nodes.energy_j.to_numpy(dtype=np.float64),
                   nodes.tree_id.map(model_of).to_numpy(dtype=object))

    def self_targets(self) -> tuple[np.ndarray, np.ndarray]:
        """For `self` rows: parent's energy minus its measured children's (NaN when the parent
        or a child is unmeasured), and the parent's energy (the relative-error scale)."""
        is_self = (self.nodes.level == SELF).to_numpy()
        parent = self.index.parent
        child_sum = np.zeros(len(parent))
        has_nan = np.zeros(len(parent), dtype=bool)
        real = (~is_self) & (parent >= 0)
        np.add.at(child_sum, parent[real], np.nan_to_num(self.measured[real]))
        np.logical_or.at(has_nan, parent[real], np.isnan(self.measured[real]))
        target = np.full(len(parent), np.nan)
        scale = np.full(len(parent), np.nan)
        p = parent[is_self]
        ok = ~has_nan[p] & ~np.isnan(self.measured[p])
        rows = np.flatnonzero(is_self)
        target[rows[ok]] = self.measured[p[ok]] - child_sum[p[ok]]
        scale[rows] = self.measured[p]
        return target, scale


class TreeCombiner(BaseEstimator):
    """alpha(c) = 1 + tanh(W.z(c) + b) / tau for every child c of an inner node (IrEne Eq. 3),
    with z the child's standardized combiner features. mode "end2end" trains on the relative
    squared error of every measured inner node with predictions flowing up from the leaves
    (Eq. 4); mode "stepwise" trains each parent on its children's measured energies (Eq. 5)."""

    def __init__(self, tau: float = 10.0, mode: str = "end2end", l2: float = 1e-4,
                 max_iter: int = 400) -> None:
        self.tau = tau
        self.mode = mode
        self.l2 = l2
        self.max_iter = max_iter

    def alpha(self, Z: np.ndarray) -> np.ndarray:
        check_is_fitted(self, "coef_")
        return 1.0 + np.tanh(self._standard(Z) @ self.coef_ + self.intercept_) / self.tau

    def _standard(self, Z: np.ndarray) -> np.ndarray:
        return (Z - self.mean_) / self.scale_

    def fit(self, Z: np.ndarray, index: TreeIndex, child_pred: np.ndarray,
            measured: np.ndarray) -> TreeCombiner:
        """child_pred: each node's input to its parent's sum — leaf predictions (end2end) or
        measured energies where known (stepwise). measured: NaN where unmeasured."""
        Z = np.asarray(Z, dtype=np.float64)
        self.mean_ = Z.mean(axis=0)
        self.scale_ = np.where(Z.std(axis=0) > 0, Z.std(axis=0), 1.0)
        Zs = self._standard(Z)
        target = (~index.is_leaf) & np.isfinite(measured)
        G = np.where(target, measured, 1.0)
        n_target = max(int(target.sum()), 1)
        parent = index.parent
        has_parent = parent >= 0

        def loss_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
            W, b = theta[:-1], theta[-1]
            t = np.tanh(Zs @ W + b)
            alpha = 1.0 + t / self.tau
            if self.mode == "end2end":
                P = index.aggregate(child_pred, alpha)
            else:  # one level: each parent from its children's given energies
                P = np.zeros(len(parent))
                np.add.at(P, parent[has_parent], alpha[has_parent] * child_pred[has_parent])
            r = np.where(target, (P - G) / G, 0.0)
            loss = float((r ** 2).sum()) / n_target + self.l2 * float(W @ W)
            dP = np.where(target, 2.0 * r / G, 0.0) / n_target
            if self.mode == "end2end":  # dL/dP flows down: P(parent) = sum alpha(c) P(c)
                for rows in index.levels[1:]:
                    dP[rows] += alpha[rows] * dP[parent[rows]]
                inputs = P
            else:
                inputs = child_pred
            d_alpha = np.zeros(len(parent))
            d_alpha[has_parent] = dP[parent[has_parent]] * inputs[has_parent]
            d_u = d_alpha * (1.0 - t ** 2) / self.tau
            grad = np.concatenate([Zs.T @ d_u + 2 * self.l2 * W, [d_u.sum()]])
            return loss, grad

        theta0 = np.zeros(Z.shape[1] + 1)
        res = minimize(loss_grad, theta0, jac=True, method="L-BFGS-B",
                       options={"maxiter": self.max_iter})
        self.coef_, self.intercept_ = res.x[:-1], float(res.x[-1])
        self.loss_ = float(res.fun)
        self.converged_ = bool(res.success)
        if not res.success:  # the fit is still usable (a descent from alpha = 1), but say so
            log.warning("combiner fit did not converge in %d iterations: %s",
                        self.max_iter, res.message)
        self.n_features_in_ = Z.shape[1]
        return self


class ModelLevelRegressor(BaseEstimator):
    """PIE-P Eq. 3: model energy = R(attention energy + MLP energy + AllReduce energy + ...).

    The inputs are the tree's predicted energies summed by component (each leaf's share of the
    root, `TreeIndex.path_weight`); R is linear with non-negative coefficients, fitted on
    relative error, so it rescales components and stays a sum of them, plus an intercept: a
    fixed energy per forward call that no module owns (launch and synchronization overhead; on
    IrEne's data, leave-one-model-out, it lowers the model-level error from 1.44 % to 1.32 %,
    most on the smallest model, tiny-ctrl: 7.35 % to 6.38 %)."""

    def __init__(self, components: Sequence[str] = MODEL_COMPONENTS,
                 fit_intercept: bool = True) -> None:
        self.components = components
        self.fit_intercept = fit_intercept

    def fit(self, X: np.ndarray, y: np.ndarray) -> ModelLevelRegressor:
        self.model_ = LinearRegression(fit_intercept=self.fit_intercept, positive=True)
        self.model_.fit(X, y, sample_weight=1.0 / np.asarray(y, dtype=np.float64) ** 2)
        self.n_features_in_ = np.asarray(X).shape[1]
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        check_is_fitted(self, "model_")
        return self.model_.predict(np.asarray(X, dtype=np.float64))


@dataclass
class Predictions:
    """Every node of the predicted trees with `predicted_j` (and the model level's)."""

    nodes: pd.DataFrame


class TreePredictor(BaseEstimator):
    """The whole multi-level regressor.

    The defaults are the configuration that predicts best on IrEne's data, leave-one-model-out
    (README): alpha = 1 with `self` leaves fitted end to end on the parents' relative error; the
    learned combiner and the model-level regressor are options, since there they generalize
    worse to an unseen model (they fit how resource levels scale sums, and those levels shift
    from model to model).

    combiner: "end2end" (IrEne), "stepwise", "sum" (PredictedSum: alpha = 1, nothing learned).
    combiner_features: "resource" (IrEne) or "level"; combiner_l2: its ridge penalty.
    self_nodes: add each inner node's remainder as a `self` leaf (see `prepare_nodes`).
    self_fit: "residual" fits the `self` regressor to what the parent's measured energy leaves
        after its predicted children (re-fitted `self_rounds` times, since children's
        predictions include their own `self` leaves), so that each parent's error, not each
        remainder's, is minimized; "measured" fits it to parent minus measured children.
    model_level: apply PIE-P's model-level regressor (Eq. 3) at the roots.
    leaf_scope: "select" (default): one regressor per node type where an inner
        leave-one-model-out over the training models shows it predicts that type better than
        the regressor shared by its level, else the shared one; "type": per type whenever a
        type has `min_type_rows` rows; "level": shared per level only.
    leaf_kind: "linear" or "gbr"; leaf_target "linear" or "log"; leaf_exposure: see
        `EnergyRegressor.exposure`; leaf_spec: the leaf features (default `energy_terms`).
    """

    def __init__(self, combiner: str = "sum", tau: float = 10.0, self_nodes: bool = True,
                 self_fit: str = "residual", self_rounds: int = 3, model_level: bool = False,
                 leaf_scope: str = "select", leaf_kind: str = "linear", min_type_rows: int = 20,
                 leaf_spec: FeatureSpec | None = None, leaf_target: str = "linear",
                 leaf_exposure: int | None = None, combiner_l2: float = 1e-4,
                 combiner_features: str = "resource") -> None:
        self.combiner = combiner
        self.combiner_l2 = combiner_l2
        self.combiner_features = combiner_features
        self.tau = tau
        self.self_nodes = self_nodes
        self.self_fit = self_fit
        self.self_rounds = self_rounds
        self.model_level = model_level
        self.leaf_scope = leaf_scope
        self.leaf_kind = leaf_kind
        self.min_type_rows = min_type_rows
        self.leaf_spec = leaf_spec
        self.leaf_target = leaf_target
        self.leaf_exposure = leaf_exposure

    def combiner_spec(self, features: Sequence[str]) -> FeatureSpec:
        """The child features alpha reads: "resource" (IrEne: resource levels, input size,
        level) or "level" (the child's level only: one calibration weight per level)."""
        have = set(features)
        cols = [f"level_is_{lv}" for lv in LEVEL_FLAGS]
        if self.combiner_features == "resource":
            cols = [r for r in RESOURCE if r in have] + [
                c for c in ("batch_size", "seq_len") if c in have] + cols
        return FeatureSpec(tuple(cols))

    # -- fit ----------------------------------------------------------------------------------
    def fit(self, ds: TreeDataset) -> TreePredictor:
        if self.combiner not in ("end2end", "stepwise", "sum"):
            raise ValueError(f"combiner {self.combiner!r}: end2end, stepwise or sum")
        if self.leaf_scope not in ("select", "type", "level"):
            raise ValueError(f"leaf_scope {self.leaf_scope!r}: select, type or level")
        self.spec_ = self.leaf_spec or energy_terms(ds.features, ds.nodes)
        batch = NodeBatch.build(ds, self.spec_, self.self_nodes)
        X = self.spec_.matrix(batch.nodes)
        self._check_finite(batch, X)
        self._fit_leaves(batch, X)
        leaf_pred = self._leaf_predict(batch.nodes, X, batch.index.is_leaf)
        self.combiner_spec_ = self.combiner_spec(ds.features)
        Z = self.combiner_spec_.matrix(batch.nodes)
        has_inner = not batch.index.is_leaf.all()
        if self.combiner == "sum" or not has_inner:
            self.combiner_ = None
        else:
            child = leaf_pred
            if self.combiner == "stepwise":
                target, _ = batch.self_targets()
                known = np.where(np.isfinite(target), target, batch.measured)
                child = np.where(np.isfinite(known), known, leaf_pred)
            self.combiner_ = TreeCombiner(tau=self.tau, mode=self.combiner,
                                          l2=self.combiner_l2).fit(
                Z, batch.index, child, batch.measured)
        if self.self_nodes and self.self_fit == "residual" and has_inner:
            alpha = np.ones(len(X)) if self.combiner_ is None else self.combiner_.alpha(Z)
            for _ in range(self.self_rounds):
                self._refit_self_on_residuals(batch, X, alpha)
            leaf_pred = self._leaf_predict(batch.nodes, X, batch.index.is_leaf)
        self.model_regressor_ = None
        if self.model_level and not batch.index.is_leaf[batch.index.parent < 0].all():
            pred, share = self._tree_predict(batch, leaf_pred, Z)
            Xc, roots = component_matrix(batch.nodes, batch.index, share, MODEL_COMPONENTS)
            y = batch.measured[roots]
            ok = np.isfinite(y)
            if not ok.any():
                raise ValueError("no measured model (root) energy in the training trees: "
                                 "the model-level regressor has nothing to fit "
                                 "(model_level=False to train without it)")
            self.model_regressor_ = ModelLevelRegressor().fit(Xc[ok], y[ok])
        return self

    def _check_finite(self, batch: NodeBatch, X: np.ndarray) -> None:
        """A leaf with a measured energy but a missing feature is a data error: name it."""
        rows = batch.index.is_leaf & np.isfinite(batch.measured)
        bad = ~np.isfinite(X[rows]).all(axis=0)
        if bad.any():
            cols = [c for c, b in zip(self.spec_.columns, bad) if b]
            raise ValueError(f"leaf features {cols} are missing (NaN) on measured leaves; "
                             "fill them or train with a leaf_spec without them")

    def _new_leaf(self) -> EnergyRegressor:
        return EnergyRegressor(kind=self.leaf_kind, target=self.leaf_target,
                               fit_intercept=self.leaf_target == "log",
                               exposure=self.leaf_exposure)

    def _fit_on(self, X: np.ndarray, y: np.ndarray, w: np.ndarray,
                rows: np.ndarray) -> EnergyRegressor:
        return self._new_leaf().fit(X[rows], y[rows], sample_weight=(
            None if self.leaf_target == "log" else w[rows]))

    def _fit_leaves(self, batch: NodeBatch, X: np.ndarray) -> None:
        nodes = batch.nodes
        type_key, level_key = leaf_keys(nodes)
        y = batch.measured.copy()
        weight = np.where(np.isfinite(y), 1.0 / np.where(np.isfinite(y), y, 1.0) ** 2, np.nan)
        target, scale = batch.self_targets()
        is_self = (nodes.level == SELF).to_numpy()
        y[is_self] = target[is_self]
        weight[is_self] = 1.0 / scale[is_self] ** 2
        usable = batch.index.is_leaf & np.isfinite(y) & np.isfinite(weight)
        if self.leaf_target == "log":
            usable &= y > 0
        self.leaves_: dict[str, EnergyRegressor] = {}
        self.leaf_choice_: dict[str, str] = {}
        for key in np.unique(level_key[usable]):
            self.leaves_[key] = self._fit_on(X, y, weight, usable & (level_key == key))
        if self.leaf_scope == "level":
            return
        for key in np.unique(type_key[usable & ~is_self]):
            rows = usable & (type_key == key)
            if rows.sum() < self.min_type_rows:
                continue
            level_rows = usable & (level_key == level_key[rows][0])
            if self.leaf_scope == "select":
                choice = self._inner_choice(batch.models, X, y, weight, rows, level_rows)
                self.leaf_choice_[key] = choice
                if choice != "type":
                    continue
            self.leaves_[key] = self._fit_on(X, y, weight, rows)

    def _inner_choice(self, models: np.ndarray, X: np.ndarray, y: np.ndarray,
                      w: np.ndarray, rows: np.ndarray, level_rows: np.ndarray) -> str:
        """'type' if a per-type regressor beats the level's one on held-out training models
        (leave-one-model-out inside the training split), else 'level'."""
        err = {"type": [], "level": []}
        for model in np.unique(models[rows]):
            test = rows & (models == model)
            train_type = rows & (models != model)
            if train_type.sum() < self.min_type_rows:
                continue
            for name, train in (("type", train_type), ("level", level_rows & (models != model))):
                pred = self._fit_on(X, y, w, train).predict(X[test])
                err[name].append(float(np.mean(np.abs(pred - y[test]) / np.abs(y[test]))))
        if not err["type"]:
            return "level (one model has this type)"
        return "type" if np.mean(err["type"]) < np.mean(err["level"]) else "level"

    def _refit_self_on_residuals(self, batch: NodeBatch, X: np.ndarray,
                                 alpha: np.ndarray) -> None:
        """P(n) = sum over real children of alpha P(c) + alpha_self P_self: fit P_self to
        (G(n) - the children's part) / alpha_self, weighted by 1/G(n)^2 (n's relative error)."""
        index = batch.index
        is_self = (batch.nodes.level == SELF).to_numpy()
        pred = index.aggregate(self._leaf_predict(batch.nodes, X), alpha)
        parent = index.parent
        real = ~is_self & (parent >= 0)
        explained = np.zeros(len(X))
        np.add.at(explained, parent[real], alpha[real] * pred[real])
        g = batch.measured[parent[is_self]]
        target = np.full(len(X), np.nan)
        target[is_self] = (g - explained[parent[is_self]]) / alpha[is_self]
        weight = np.full(len(X), np.nan)
        weight[is_self] = (alpha[is_self] / g) ** 2
        rows = is_self & np.isfinite(target)
        if rows.any():
            self.leaves_["self:*"] = self._fit_on(X, target, weight, rows)

    def leaf_key_of(self, nodes: pd.DataFrame) -> np.ndarray:
        return choose_leaf_key(nodes, self.leaves_)

    def _leaf_predict(self, nodes: pd.DataFrame, X: np.ndarray,
                      leaf: np.ndarray | None = None) -> np.ndarray:
        """Leaf regressors' predictions (NaN at inner rows). A leaf row that no regressor
        covers raises `UncoveredLeaves`: predicting 0 J for it would be silent and wrong."""
        keys = self.leaf_key_of(nodes)
        if leaf is not None:
            check_leaf_coverage(nodes, keys, leaf)
        out = np.full(len(nodes), np.nan)
        for key in np.unique(keys):
            if key:
                rows = keys == key
                out[rows] = self.leaves_[key].predict(X[rows])
        return out

    def _tree_predict(self, batch: NodeBatch, leaf_pred: np.ndarray,
                      Z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        alpha = (np.ones(len(Z)) if self.combiner_ is None else self.combiner_.alpha(Z))
        pred = batch.index.aggregate(leaf_pred, alpha)
        share = batch.index.path_weight(alpha) * pred
        return pred, share

    # -- predict ------------------------------------------------------------------------------
    def predict(self, ds: TreeDataset) -> Predictions:
        """Predictions for every node of `ds`'s trees (self nodes included, level 'self');
        roots carry the model-level regressor's output when there is one."""
        check_is_fitted(self, "leaves_")
        batch = NodeBatch.build(ds, self.spec_, self.self_nodes)
        X = self.spec_.matrix(batch.nodes)
        leaf_pred = self._leaf_predict(batch.nodes, X, batch.index.is_leaf)
        Z = self.combiner_spec_.matrix(batch.nodes)
        pred, share = self._tree_predict(batch, leaf_pred, Z)
        nodes = batch.nodes.copy()
        nodes["tree_pred_j"] = pred
        if self.model_regressor_ is not None:
            Xc, roots = component_matrix(batch.nodes, batch.index, share, MODEL_COMPONENTS)
            inner_roots = ~batch.index.is_leaf[roots]
            pred = pred.copy()
            pred[roots[inner_roots]] = self.model_regressor_.predict(Xc[inner_roots])
        nodes["predicted_j"] = pred
        return Predictions(nodes)

