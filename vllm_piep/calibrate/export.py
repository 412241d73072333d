"""A fitted `TreePredictor` as an ONNX bundle: one directory with `manifest.json` and ONNX files.

Leaves and the model-level regressor are scikit-learn pipelines converted by skl2onnx; the
combiner (alpha = 1 + tanh(W.z + b) / tau on standardized z) is a seven-node ONNX graph written
here. Everything is float64 so that onnxruntime reproduces the training-time predictions to
1e-5 relative (energy terms can cancel, and float32 would not). The manifest names the feature
order, the scalers (inside the graphs, and the combiner's in the manifest too), versions,
hardware, training data, metrics and the command that remakes the bundle; it is validated
against `MANIFEST_SCHEMA` on write and on load, and its prediction-deciding fields are covered
by `content_sha256` as the ONNX files are by theirs. Nothing is pickled.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from skl2onnx import convert_sklearn
from skl2onnx.common.data_types import DoubleTensorType

from vllm_piep.calibrate.train import EXTENSIVE, TreePredictor
from vllm_piep.datasets.model import TreeDataset
from vllm_piep.predict.bundle import (
    MANIFEST_SCHEMA,
    SCHEMA_ID,
    content_digest,
    validate_manifest,
)
from vllm_piep.predict.treeeval import MODEL_COMPONENTS

OPSET = 17


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("vllm_piep", "numpy", "scikit-learn", "skl2onnx", "onnx", "onnxruntime"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def _sklearn_onnx(pipeline: object, n_inputs: int, path: Path) -> None:
    pipeline = copy.deepcopy(pipeline)
    for est in getattr(pipeline, "named_steps", {"m": pipeline}).values():
        # skl2onnx reads intercept_ as an array; without an intercept sklearn stores 0.0.
        if isinstance(getattr(est, "intercept_", None), float):
            est.intercept_ = np.array([est.intercept_])
    model = convert_sklearn(pipeline, initial_types=[("X", DoubleTensorType([None, n_inputs]))],
                            target_opset=OPSET)
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())


def combiner_graph(mean: np.ndarray, scale: np.ndarray, coef: np.ndarray, intercept: float,
                   tau: float) -> onnx.ModelProto:
    """alpha [N, 1] = 1 + tanh(((Z - mean) / scale) @ W + b) / tau for Z [N, F] float64."""
    f = len(mean)
    init = [numpy_helper.from_array(np.asarray(v, dtype=np.float64), name) for name, v in (
        ("mean", mean), ("scale", scale), ("W", np.asarray(coef).reshape(f, 1)),
        ("b", np.array([intercept])), ("tau", np.array([tau])), ("one", np.array([1.0])))]
    nodes = [
        helper.make_node("Sub", ["Z", "mean"], ["centred"]),
        helper.make_node("Div", ["centred", "scale"], ["z"]),
        helper.make_node("MatMul", ["z", "W"], ["u0"]),
        helper.make_node("Add", ["u0", "b"], ["u"]),
        helper.make_node("Tanh", ["u"], ["t"]),
        helper.make_node("Div", ["t", "tau"], ["t_tau"]),
        helper.make_node("Add", ["t_tau", "one"], ["alpha"]),
    ]
    graph = helper.make_graph(
        nodes, "piep_combiner",
        [helper.make_tensor_value_info("Z", TensorProto.DOUBLE, [None, f])],
        [helper.make_tensor_value_info("alpha", TensorProto.DOUBLE, [None, 1])], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="vllm_piep")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def export_bundle(predictor: TreePredictor, ds: TreeDataset, out_dir: str | Path, *,
                  hardware: str, command: str, metrics: dict[str, object] | None = None,
                  serve_features: list[str] | None = None, ground_truth: str = "",
                  serving: dict[str, object] | None = None,
                  bundle_name: str | None = None) -> Path:
    """Write the bundle directory; returns the manifest's path. `serving`: what the serve
    path needs besides the regressors (`predict.served`); other ONNX files already in
    `out_dir` (e.g. a step-time model it names) are hashed with the rest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    leaves = []
    for i, (key, leaf) in enumerate(sorted(predictor.leaves_.items())):
        name = f"leaf_{i:03d}.onnx"
        n_inputs = leaf.pipeline_.n_features_in_  # the exposure column is not an input
        if n_inputs != leaf.n_features_in_ - (leaf.exposure is not None):
            raise ValueError(f"leaf {key!r}: a constant-power leaf (exposure only) has no "
                             "ONNX form here; give it at least one feature")
        _sklearn_onnx(leaf.pipeline_, n_inputs, out / name)
        leaves.append({"key": key, "file": name, "kind": leaf.kind, "target": leaf.target,
                       "exposure": leaf.exposure, "n_inputs": n_inputs})
    combiner = None
    if predictor.combiner_ is not None:
        c = predictor.combiner_
        (out / "combiner.onnx").write_bytes(combiner_graph(
            c.mean_, c.scale_, c.coef_, c.intercept_, c.tau).SerializeToString())
        combiner = {"file": "combiner.onnx", "tau": c.tau, "mode": c.mode,
                    "mean": c.mean_.tolist(), "scale": c.scale_.tolist()}
    model_level = None
    if predictor.model_regressor_ is not None:
        _sklearn_onnx(predictor.model_regressor_.model_, len(MODEL_COMPONENTS),
                      out / "model_level.onnx")
        model_level = {"file": "model_level.onnx", "components": list(MODEL_COMPONENTS)}
    files = sorted(p.name for p in out.glob("*.onnx"))
    manifest = {
        "schema": SCHEMA_ID,
        "bundle_id": "",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "versions": _versions(),
        "hardware": hardware,
        "training_data": {"dataset": ds.name, "trees": int(len(ds.trees)),
                          "nodes": int(len(ds.nodes)), "models": ds.models,
                          "bad_rows_skipped": len(ds.issues),
                          # which meter measured the energies the bundle was trained on
                          "ground_truth": ground_truth or "unstated"},
        "metrics": metrics or {},
        "how_to_remake": command,
        "features": {
            "leaf": predictor.spec_.to_dict()["columns"],
            "combiner": (predictor.combiner_spec_.to_dict()["columns"]
                         if combiner else []),
            "extensive": list(EXTENSIVE),
            # node features the input must carry (level flags are derived from `level`)
            "inputs": sorted(f for f in set(predictor.spec_.inputs) | (
                set(predictor.combiner_spec_.inputs) if combiner else set())
                if not f.startswith("level_is_")),
            "serve": serve_features or [],
        },
        "self_nodes": bool(predictor.self_nodes),
        # per node type: its own regressor or its level's, and why (inner leave-one-model-out)
        "leaf_selection": dict(predictor.leaf_choice_),
        "leaves": leaves,
        "combiner": combiner,
        "model_level": model_level,
        "sha256": {f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in files},
    }
    if serving is not None:
        manifest["serving"] = serving
    manifest["content_sha256"] = content_digest(manifest)
    manifest["bundle_id"] = f"{bundle_name or ds.name}-{manifest['content_sha256'][:12]}"
    validate_manifest(manifest)
    path = out / "manifest.json"
    path.write_text(json.dumps(manifest, indent=1))
    return path


__all__ = ["MANIFEST_SCHEMA", "combiner_graph", "export_bundle"]
