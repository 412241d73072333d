"""A calibrated bundle on the serve path: a step's energy from what the engine knows.

The campaign trains the bundle's leaves on detail-mode measurements (repeated sampling), but
predicts with features the serve path has for every step: the model's shape and parallel
layout, the step's token counts and context (`flops.StepTotals`), the number of requests, the
step time, and constants the campaign measured (the idle power of each configuration, and the
mean synchronization wait per collective). `step_nodes` builds a step's node table from the
bundle's tree template for the configuration; the campaign builds its training features with
the same function, so training and serving read identical features by construction.

Per node (all ranks that run it together, since the meter measures all devices):
- `gflop`, `mem_mib`: the module's work per tensor-parallel rank times the ranks that run it
  (`flops.module_work_of_totals`, replicated work counted on every rank);
- `comm_mib`: a transfer's payload per call (the whole tensor);
- `wait_s`: on wait nodes, the configuration's mean wait for that collective (synchronization
  sampling), else 0;
- `calls`: the ranks that execute the node (all ranks for the step overhead);
- `batch_size`: requests in the step.
Static energy (the idle power of the configuration times the step time) is added outside the
tree; the `overhead` leaf (input preparation, sampling, scheduling) goes to `static` too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pandas as pd

from vllm_piep.meters.common import Source as MeterSource
from vllm_piep.model.components import INDEX, STATIC
from vllm_piep.model.devices import DeviceProfile
from vllm_piep.model.flops import ModelShape, StepBatch, StepTotals, module_work_of_totals
from vllm_piep.predict.base import GraphPredictor, Interval, Source, StepInput, fitted_source
from vllm_piep.predict.bundle import BundleError, TreeBundle
from vllm_piep.predict.featurespec import FeatureSpec
from vllm_piep.predict.stepgraph import (
    GRAPH_FEATURES,
    ROWS_SAMPLED,
    SUM_OF,
    StepGraphSpec,
    work_key,
)
from vllm_piep.predict.treeeval import TreeIndex, check_leaf_coverage, choose_leaf_key

log = logging.getLogger(__name__)

SERVE_FEATURES: tuple[str, ...] = ("gflop", "mem_mib", "comm_mib", "wait_s", "calls",
                                   "batch_size")
TEMPLATE_COLUMNS = ("node_id", "parent_id", "level", "type", "component")
MODEL_SIZE_FIELDS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim",
                     "vocab", "gated_mlp")
MIB = float(2**20)
_LAYER = re.compile(r"^layers\.(\d+)\.")
_LAYERED = ("attention", "mlp", "attention_norm", "mlp_norm")


# `serving.meter` as the campaign writes it (`calibrate.campaign_data`): "<name> (<kind>)".
_METER_LABEL = re.compile(r"^(?P<name>.+) \((?P<kind>%s)\)$" % "|".join(get_args(MeterSource)))


def meter_of_label(label: str) -> tuple[str, MeterSource | None]:
    """(name, kind) of the meter a bundle's `serving.meter` names, e.g. `cpu-estimate
    (estimated)`; kind None where the label does not say it (a bundle made otherwise)."""
    found = _METER_LABEL.match(label.strip())
    if found is None:
        return label.strip(), None
    return found["name"], found["kind"]  # type: ignore[return-value]


def config_name(tp: int, pp: int) -> str:
    return f"tp{tp}-pp{pp}"


def parse_config(name: str) -> tuple[int, int]:
    """(tp, pp) of a `config_name`."""
    t, p = (int(x) for x in re.findall(r"\d+", name)[:2])
    return t, p


def template_of(tree_nodes: pd.DataFrame) -> list[dict[str, str]]:
    """A dataset tree's structure (its nodes' ids, parents, levels, types, components)."""
    return [{c: str(v) for c, v in zip(TEMPLATE_COLUMNS, row)}
            for row in tree_nodes[list(TEMPLATE_COLUMNS)].itertuples(index=False)]


def _work_key(node_id: str, node_type: str) -> str | None:
    if node_type in _LAYERED:
        m = _LAYER.match(node_id)
        return f"layers.{m.group(1)}.{node_type}" if m else None
    if node_type in ("embedding", "final_norm", "logits"):
        return node_type
    return None


@dataclass(frozen=True)
class StepTemplate:
    """A configuration's tree, with what each node's features come from."""

    nodes: pd.DataFrame  # TEMPLATE_COLUMNS
    work_key: list[str | None]  # module nodes: their `module_work_of_totals` name
    comm_key: list[str | None]  # transfer nodes: that name of the module the collective ends
    comm_op: list[str | None]  # transfer and wait nodes: their collective op
    parent: np.ndarray  # row of each node's parent (-1: root)
    is_leaf: np.ndarray
    deepest_first: np.ndarray  # row order for summing children into parents

    @cached_property
    def module_rows(self) -> list[tuple[int, str]]:
        return [(i, k) for i, k in enumerate(self.work_key) if k is not None]

    @cached_property
    def transfer_rows(self) -> list[tuple[int, str]]:
        types = self.nodes.type.to_numpy()
        return [(i, k or "") for i, k in enumerate(self.comm_key) if types[i] == "transfer"]

    @cached_property
    def wait_rows(self) -> list[tuple[int, str]]:
        types = self.nodes.type.to_numpy()
        return [(i, op or "") for i, op in enumerate(self.comm_op) if types[i] == "wait"]

    @cached_property
    def overhead_rows(self) -> np.ndarray:
        return (self.nodes.type == "overhead").to_numpy()

    @classmethod
    def build(cls, rows: Sequence[Mapping[str, str]]) -> StepTemplate:
        nodes = pd.DataFrame(list(rows), columns=list(TEMPLATE_COLUMNS))
        types = dict(zip(nodes.node_id, nodes.type))
        work_key, comm_key, comm_op = [], [], []
        for r in nodes.itertuples():
            work_key.append(_work_key(r.node_id, r.type))
            # "layers.0.self_attn@all_reduce/transfer": the collective ending that module
            base = r.node_id.rsplit("/", 1)[0] if r.type in ("transfer", "wait") else ""
            module, _, op = base.partition("@")
            comm_key.append(_work_key(module, types.get(module, "")) if op else None)
            comm_op.append(op or None)
        index = TreeIndex.build(["t"] * len(nodes), nodes.node_id.tolist(),
                                nodes.parent_id.tolist())
        return cls(nodes, work_key, comm_key, comm_op, index.parent, index.is_leaf,
                   np.argsort(-index.depth))


def step_features(template: StepTemplate, shape: ModelShape, totals: StepTotals,
                  batch_size: float, wait_s: Mapping[str, float]) -> dict[str, np.ndarray]:
    """`SERVE_FEATURES` of every template node for one step (module docstring), as arrays:
    the serve path's form (no DataFrame per step). Inner nodes carry the sums of their
    children's gflop, mem_mib and comm_mib."""
    work = module_work_of_totals(shape, totals, per_rank=True)
    tp = float(shape.tp)
    n = len(template.nodes)
    gflop, mem, comm, wait = (np.zeros(n) for _ in range(4))
    calls = np.full(n, tp)
    for i, key in template.module_rows:
        w = work[key]
        gflop[i], mem[i] = w.flops * tp / 1e9, w.bytes * tp / MIB
    for i, key in template.transfer_rows:
        w = work.get(key)
        comm[i] = w.collective_bytes / MIB if w is not None else 0.0
    for i, op in template.wait_rows:
        wait[i] = float(wait_s.get(op, 0.0))
    calls[template.overhead_rows] = float(shape.tp * shape.pp)  # every rank runs a step
    for col in (gflop, mem, comm):  # inner nodes: sums of their children, deepest first
        col[~template.is_leaf] = 0.0
        for i in template.deepest_first:
            p = template.parent[i]
            if p >= 0:
                col[p] += col[i]
    return {"gflop": gflop, "mem_mib": mem, "comm_mib": comm, "wait_s": wait, "calls": calls,
            "batch_size": np.full(n, float(batch_size))}


def step_nodes(template: StepTemplate, shape: ModelShape, totals: StepTotals,
               batch_size: float, wait_s: Mapping[str, float]) -> pd.DataFrame:
    """The step's node table: the template plus `step_features` (the dataset's and the
    reference evaluation's form)."""
    return template.nodes.assign(**step_features(template, shape, totals, batch_size, wait_s))


# --------------------------------------------------------------------------- the bundle
class BundleMismatch(BundleError):
    """The bundle was made for another model or hardware."""


@dataclass(frozen=True)
class Serving:
    """The manifest's `serving` section, read."""

    architecture: str
    dtype_bytes: int
    device_type: str
    device_name: str
    static_watts: dict[str, float]  # per configuration
    static_per_device: bool  # the meter measures per device (GPUs): scale by device count
    wait_s: dict[str, dict[str, float]]  # configuration -> op -> mean wait (s)
    templates: dict[str, list[dict[str, str]]]  # configuration -> tree template
    meter: str
    shape: dict[str, Any]  # the calibrated model's ModelShape fields
    interval: Interval | None = None  # split-conformal multipliers, if the bundle has them

    @classmethod
    def of(cls, manifest: Mapping[str, Any]) -> Serving:
        s = manifest.get("serving")
        if not isinstance(s, Mapping):
            raise BundleError(f"bundle {manifest.get('bundle_id')}: no `serving` section "
                              "(made by `calibrate train`, not `calibrate run`): it cannot "
                              "predict served steps")
        return cls(str(s["architecture"]), int(s["dtype_bytes"]), str(s["device_type"]),
                   str(s["device_name"]), {k: float(v) for k, v in s["static_watts"].items()},
                   bool(s["static_per_device"]),
                   {k: {o: float(w) for o, w in v.items()} for k, v in s["wait_s"].items()},
                   dict(s["templates"]), str(s["meter"]), dict(s["shape"]),
                   _interval(s.get("interval"), str(manifest.get("bundle_id"))))

    def nearest(self, table: Mapping[str, Any], tp: int, pp: int) -> tuple[str, Any]:
        """The entry for (tp, pp), else the measured configuration nearest to it (same
        parallel kinds first: with or without TP, with or without PP), and its name."""
        want = config_name(tp, pp)
        if want in table:
            return want, table[want]

        def distance(name: str) -> tuple[int, float]:
            t, p = parse_config(name)
            kinds = ((t > 1) != (tp > 1)) + ((p > 1) != (pp > 1))
            return kinds, abs(np.log2(t / tp)) + abs(np.log2(p / pp))

        name = min(table, key=distance)
        return name, table[name]


def _interval(raw: object, bundle_id: str) -> Interval | None:
    """The manifest's `serving.interval` (older bundles have none)."""
    if raw is None:
        return None
    try:
        assert isinstance(raw, Mapping)
        coverage = raw.get("coverage")
        interval = Interval(float(raw["lower"]), float(raw["upper"]), float(raw["level"]),
                            float(coverage["mean"]) if isinstance(coverage, Mapping) else None)
    except (AssertionError, KeyError, TypeError, ValueError):
        raise BundleError(f"bundle {bundle_id}: unreadable serving.interval {raw!r:.200}") from None
    if not (0.0 <= interval.lower <= 1.0 <= interval.upper < float("inf")
            and 0.0 < interval.level < 1.0):
        raise BundleError(f"bundle {bundle_id}: serving.interval {raw!r:.200} is not a "
                          "multiplier range around 1 at a level in (0, 1)")
    return interval


class BundlePredictor(GraphPredictor):
    """`Predictor` backed by a calibrated bundle: its leaves folded into one step graph.

    It says `calibrated` where the bundle's meter (`serving.meter`) measures; a bundle fitted
    to a CPU estimate or a simulator says `estimated` or `simulated`, and its id names that
    meter (`<bundle id> (fit to <meter>)`). A bundle whose meter label does not say its kind
    (not made by the campaign) is served as calibrated.

    The campaign's leaves are linear regressors of features that are themselves affine in
    the step's per-feature sums (tokens, attended pairs, context, sampled rows, requests, and
    whether any row is sampled), so each leaf's energy is an affine function of those sums.
    The maps are read off the bundle's ONNX leaves at load (evaluated through onnxruntime on
    the reference path at basis points) and verified on random steps against that path; a
    bundle whose leaves are not affine (boosted trees, log targets) is refused with a clear
    error, and the loader falls back to the prior.
    """

    source: Source = "calibrated"

    def __init__(self, bundle: TreeBundle, shape: ModelShape,
                 profile: DeviceProfile | None = None) -> None:
        self.bundle = bundle
        self.shape = shape
        self.serving = Serving.of(bundle.manifest)
        meter, kind = meter_of_label(self.serving.meter)
        self.source = fitted_source(kind or "measured")
        self.bundle_id = (bundle.bundle_id if self.source == "calibrated"
                          else f"{bundle.bundle_id} (fit to {meter})")
        cfg, rows = self.serving.nearest(self.serving.templates, shape.tp, shape.pp)
        self.template = StepTemplate.build(rows)
        self.template_config = cfg
        self.wait_s: Mapping[str, float] = (
            self.serving.nearest(self.serving.wait_s, shape.tp, shape.pp)[1]
            if self.serving.wait_s else {})
        static_cfg, watts = self.serving.nearest(self.serving.static_watts, shape.tp, shape.pp)
        if self.serving.static_per_device:
            t, p = parse_config(static_cfg)
            watts = watts * (shape.tp * shape.pp) / (t * p)
        self.static_watts = float(watts)
        self.interval = self.serving.interval
        spec = bundle.leaf_spec
        missing = set(spec.inputs) - set(SERVE_FEATURES)
        if missing:
            raise BundleError(f"bundle {self.bundle_id} reads {sorted(missing)}, which the "
                              f"serve path does not supply (it supplies {SERVE_FEATURES})")
        self._spec: FeatureSpec = spec
        keys = choose_leaf_key(self.template.nodes, bundle.leaves)
        check_leaf_coverage(self.template.nodes, keys, self.template.is_leaf)
        leaf = self.template.is_leaf
        self._rows_by_key = [(str(k), np.flatnonzero(leaf & (keys == k)))
                             for k in np.unique(keys[leaf])]
        self._component = np.array([INDEX.get(c, STATIC) for c in self.template.nodes.component])
        self._leaf_rows = np.flatnonzero(leaf)
        weights, bias = self._affine_leaves()
        # Without the device's coefficients, FLOPs and bytes weigh equally in the split key.
        per = (1.0, 1.0, 1.0) if profile is None else (
            profile.joules_per_flop, profile.joules_per_byte, profile.joules_per_link_byte)
        super().__init__(StepGraphSpec(
            work_key=work_key(shape, *per), leaf_weights=weights, leaf_bias=bias,
            leaf_component=self._component[self._leaf_rows], static_watts=self.static_watts))

    @classmethod
    def load(cls, directory: str | Path, shape: ModelShape, architecture: str | None,
             device_type: str, device_name: str | None,
             profile: DeviceProfile | None = None) -> BundlePredictor:
        bundle = TreeBundle.load(directory)
        check_fit(Serving.of(bundle.manifest), shape, architecture, device_type, device_name,
                  bundle.bundle_id)
        predictor = cls(bundle, shape, profile)
        # One step before serving: a bundle that cannot predict is refused here (the prior
        # takes over) rather than failing every step.
        energy = predictor.predict_step(StepInput(StepBatch.from_rows([(4, 0, 0, 1)]), 0.01))
        if not np.isfinite(energy.joules).all():
            raise BundleError(f"bundle {bundle.bundle_id} predicts a non-finite energy")
        return predictor

    def node_leaf_values(self, totals: StepTotals, batch_size: float) -> np.ndarray:
        """Each template node's leaf regressor output, unclamped (0 at inner nodes): the
        reference path, through the bundle's ONNX leaves one call per leaf key."""
        X = self._spec.matrix(step_features(self.template, self.shape, totals, batch_size,
                                            self.wait_s))
        out = np.zeros(len(X))
        for key, rows in self._rows_by_key:
            out[rows] = self.bundle._leaf(key, X[rows])
        return out

    def leaf_joules(self, batch: StepBatch) -> np.ndarray:
        """Each template node's leaf prediction for this step (0 at inner nodes); a linear leaf
        can go slightly negative far outside its data: energy is not."""
        return np.maximum(self.node_leaf_values(StepTotals.of(batch), float(len(batch))), 0.0)

    def _affine_leaves(self) -> tuple[np.ndarray, np.ndarray]:
        """(weights [GRAPH_FEATURES, M], bias [M]) of the leaf nodes over the step's sums."""
        rows = self._leaf_rows

        def at(t: Sequence[float]) -> np.ndarray:
            tokens, pairs, context, sampled, n = t
            return self.node_leaf_values(StepTotals(tokens, pairs, context, sampled), n)[rows]

        base = np.array([64.0, 4096.0, 512.0, 8.0, 8.0])  # a step with rows sampled
        f0 = at(base)
        weights = np.zeros((len(GRAPH_FEATURES), len(rows)))
        for k, name in enumerate(AFFINE_SUMS):
            step = np.zeros(5)
            step[k] = base[k]
            weights[SUM_OF[name]] = (at(base + step) - f0) / base[k]
        bias = f0 - base @ weights[[SUM_OF[n] for n in AFFINE_SUMS]]
        no_rows = base.copy()
        no_rows[3] = 0.0  # a step of partial prefill chunks only: no logits at all
        unsampled = at(no_rows) - no_rows @ weights[[SUM_OF[n] for n in AFFINE_SUMS]]
        weights[ROWS_SAMPLED] = bias - unsampled  # the sum of row shares: 1 iff rows sampled
        bias = unsampled
        self._check_affine(weights, bias, at)
        return weights, bias

    def _check_affine(self, weights: np.ndarray, bias: np.ndarray, at: Any) -> None:
        rng = np.random.default_rng(0)
        cols = [SUM_OF[n] for n in AFFINE_SUMS]
        # Fixed corners (one decode token; a partial prefill chunk with no logits; a long
        # context), then random steps.
        points = [np.array([1.0, 1.0, 0.0, 1.0, 1.0]), np.array([512.0, 131328.0, 0.0, 0.0, 1.0]),
                  np.array([64.0, 64.0 * 65536.0, 64.0 * 65535.0, 64.0, 64.0])]
        for _ in range(8):
            n = float(rng.integers(1, 512))
            tokens = n + float(rng.integers(0, 8192))
            points.append(np.array([tokens, tokens * float(rng.integers(1, 4096)),
                                    float(rng.integers(0, 2**16)),
                                    float(rng.integers(0, n + 1)), n]))
        for t in points:
            want = at(t)
            got = t @ weights[cols] + weights[ROWS_SAMPLED] * (t[3] > 0) + bias
            scale = np.maximum(np.abs(want), np.abs(want).max() * 1e-6 + 1e-30)
            if not (np.abs(got - want) <= 1e-9 * scale).all():
                raise BundleError(
                    f"bundle {self.bundle_id}: its leaves are not affine in the step's token "
                    "totals (boosted trees or log-target leaves), which the one-call serve "
                    "path cannot fold; serve a bundle with linear leaves (the campaign's "
                    "default) or use the reference evaluation offline")


AFFINE_SUMS = ("tokens", "attended_pairs", "context", "sampled_rows", "one")


def check_fit(serving: Serving, shape: ModelShape, architecture: str | None,
              device_type: str, device_name: str | None, bundle_id: str) -> None:
    """Raise `BundleMismatch` naming what differs between the bundle and this server."""
    problems = []
    if architecture and serving.architecture and architecture != serving.architecture:
        problems.append(f"model architecture {architecture} (bundle: {serving.architecture})")
    # The leaves were measured on this model's modules: another size of the family would be
    # an extrapolation the campaign never checked.
    mine = {k: getattr(shape, k) for k in MODEL_SIZE_FIELDS}
    theirs = {k: serving.shape.get(k) for k in MODEL_SIZE_FIELDS}
    if mine != theirs:
        diff = ", ".join(f"{k} {mine[k]} (bundle: {theirs[k]})" for k in MODEL_SIZE_FIELDS
                         if mine[k] != theirs[k])
        problems.append(f"model shape: {diff}")
    if shape.dtype_bytes != serving.dtype_bytes:
        problems.append(f"dtype of {shape.dtype_bytes} bytes (bundle: {serving.dtype_bytes})")
    if device_type != serving.device_type:
        problems.append(f"device {device_type} (bundle: {serving.device_type})")
    elif device_name and serving.device_name and device_name != serving.device_name:
        problems.append(f"device {device_name!r} (bundle: {serving.device_name!r})")
    if problems:
        raise BundleMismatch(f"bundle {bundle_id} does not fit this server: "
                             + "; ".join(problems))


def reference_step_joules(bundle: TreeBundle, shape: ModelShape, totals: StepTotals,
                          batch_size: float, step_seconds: float) -> float:
    """A step's energy by the bundle's reference evaluation (`TreeBundle.predict`, the
    pandas path that matches training), for checking the serve path against it."""
    serving = BundlePredictor(bundle, shape)  # the same template, waits and static power
    nodes = step_nodes(serving.template, shape, totals, batch_size, serving.wait_s)
    pred = bundle.predict(nodes.assign(tree_id="step", scope=nodes.node_id))
    leaves = pred[pred.node_id.isin(nodes.node_id[serving.template.is_leaf])]
    return float(np.maximum(leaves.predicted_j.to_numpy(), 0.0).sum()
                 + serving.static_watts * max(step_seconds, 0.0))
