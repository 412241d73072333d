"""A calibrated predictor bundle, evaluated with onnxruntime (no scikit-learn, no pickle).

A bundle is a directory: `manifest.json` (schema `piep.bundle/1`, `MANIFEST_SCHEMA`) and the
ONNX files it names, each checked against its SHA-256. `TreeBundle.predict` evaluates node
tables exactly as `calibrate.train.TreePredictor.predict` does: the same node preparation,
leaf-regressor choice and tree sums (`predict.treeeval`), with the regressors run as ONNX.
Loading refuses a manifest that fails the schema, a missing or altered file, and, before any
prediction, input that lacks a feature the bundle reads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pandas as pd

from vllm_piep.predict.featurespec import FeatureSchemaError, FeatureSpec
from vllm_piep.predict.treeeval import (
    TreeIndex,
    check_leaf_coverage,
    choose_leaf_key,
    component_matrix,
    prepare_nodes,
)

SCHEMA_ID = "piep.bundle/1"
_STR_LIST = {"type": "array", "items": {"type": "string"}}
MANIFEST_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["schema", "bundle_id", "created", "versions", "hardware", "training_data",
                 "metrics", "how_to_remake", "features", "self_nodes", "leaves", "combiner",
                 "model_level", "sha256", "content_sha256"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "bundle_id": {"type": "string", "minLength": 1},
        "created": {"type": "string"},
        "versions": {"type": "object", "additionalProperties": {"type": "string"}},
        "hardware": {"type": "string"},
        "training_data": {"type": "object", "required": ["dataset", "trees", "models"]},
        "metrics": {"type": "object"},
        "how_to_remake": {"type": "string"},
        "features": {
            "type": "object",
            "required": ["leaf", "combiner", "extensive", "inputs", "serve"],
            "properties": {k: _STR_LIST for k in ("leaf", "combiner", "extensive", "inputs",
                                                  "serve")},
        },
        "self_nodes": {"type": "boolean"},
        "leaves": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["key", "file", "kind", "target", "exposure", "n_inputs"],
            "properties": {
                "key": {"type": "string"}, "file": {"type": "string"},
                "kind": {"enum": ["linear", "gbr"]}, "target": {"enum": ["linear", "log"]},
                "exposure": {"type": ["integer", "null"]}, "n_inputs": {"type": "integer"},
            }}},
        "combiner": {"oneOf": [{"type": "null"}, {
            "type": "object", "required": ["file", "tau", "mean", "scale"],
            "properties": {"file": {"type": "string"}, "tau": {"type": "number"}}}]},
        "model_level": {"oneOf": [{"type": "null"}, {
            "type": "object", "required": ["file", "components"],
            "properties": {"file": {"type": "string"}, "components": _STR_LIST}}]},
        "sha256": {"type": "object", "additionalProperties": {"type": "string"}},
        "content_sha256": {"type": "string", "minLength": 64, "maxLength": 64},
    },
}
# The manifest fields that decide predictions: `content_sha256` covers them, so that editing
# a feature order or a scaler after export is refused at load, as an altered ONNX file is.
# `serving` (campaign bundles: static power, waits, tree templates) is covered when present;
# a bundle without it cannot serve (`predict.served`).
CONTENT_FIELDS = ("features", "self_nodes", "leaves", "combiner", "model_level", "sha256")
OPTIONAL_CONTENT_FIELDS = ("serving",)


def content_digest(manifest: dict[str, Any]) -> str:
    body = {k: manifest[k] for k in CONTENT_FIELDS}
    body.update({k: manifest[k] for k in OPTIONAL_CONTENT_FIELDS if k in manifest})
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class BundleError(ValueError):
    """A bundle that cannot be used; the message says which file and why."""


def validate_manifest(manifest: dict[str, Any], where: str = "manifest") -> None:
    try:
        jsonschema.validate(manifest, MANIFEST_SCHEMA)
    except jsonschema.ValidationError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(top)"
        raise BundleError(f"{where}: invalid at {path}: {e.message}") from None


def _session(path: Path):  # type: ignore[no-untyped-def]
    import onnxruntime as ort
    opts = ort.SessionOptions()
    # One thread each: the predictor runs beside vLLM's own threads and must not compete.
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(str(path), sess_options=opts,
                                    providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        raise BundleError(f"{path}: not a loadable ONNX model ({e})") from None


class TreeBundle:
    """The ONNX form of a `TreePredictor`."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory = directory
        self.manifest = manifest
        feats = manifest["features"]
        self.leaf_spec = FeatureSpec(tuple(feats["leaf"]))
        self.combiner_spec = FeatureSpec(tuple(feats["combiner"]))
        self.leaves = {leaf["key"]: leaf for leaf in manifest["leaves"]}
        self._sessions = {leaf["key"]: _session(directory / leaf["file"])
                          for leaf in manifest["leaves"]}
        comb = manifest["combiner"]
        self._combiner = _session(directory / comb["file"]) if comb else None
        ml = manifest["model_level"]
        self._model_level = _session(directory / ml["file"]) if ml else None

    @property
    def bundle_id(self) -> str:
        return str(self.manifest["bundle_id"])

    @classmethod
    def load(cls, directory: str | Path) -> TreeBundle:
        d = Path(directory)
        path = d / "manifest.json"
        if not path.is_file():
            raise BundleError(f"{d}: no manifest.json (not a bundle directory)")
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise BundleError(f"{path}: not JSON ({e})") from None
        validate_manifest(manifest, str(path))
        for name, digest in manifest["sha256"].items():
            f = d / name
            if not f.is_file():
                raise BundleError(f"{f}: named in the manifest but missing")
            if hashlib.sha256(f.read_bytes()).hexdigest() != digest:
                raise BundleError(f"{f}: contents differ from the manifest's SHA-256 "
                                  "(altered or corrupt)")
        if content_digest(manifest) != manifest["content_sha256"]:
            raise BundleError(f"{path}: features, leaves, combiner or model level differ from "
                              "what was exported (content_sha256 mismatch): the manifest was "
                              "edited; remake the bundle")
        bundle = cls(d, manifest)
        bundle._check_shapes()
        return bundle

    def _check_shapes(self) -> None:
        """Each graph's input width must match the manifest's feature lists."""
        def width(session) -> object:  # type: ignore[no-untyped-def]
            return session.get_inputs()[0].shape[-1]
        n_leaf = len(self.leaf_spec.columns)
        for key, leaf in self.leaves.items():
            expected = n_leaf - (leaf["exposure"] is not None)
            if leaf["n_inputs"] != expected or width(self._sessions[key]) != expected:
                raise BundleError(f"{self.directory}: leaf {key!r} reads "
                                  f"{width(self._sessions[key])} inputs, the manifest's leaf "
                                  f"features give {expected}")
        if self._combiner is not None and width(self._combiner) != len(
                self.combiner_spec.columns):
            raise BundleError(f"{self.directory}: the combiner graph's input width differs "
                              "from the manifest's combiner features")
        if self._model_level is not None and width(self._model_level) != len(
                self.manifest["model_level"]["components"]):
            raise BundleError(f"{self.directory}: the model-level graph's input width differs "
                              "from the manifest's components")

    def check_features(self, available: Iterable[str]) -> None:
        """Refuse input that lacks a feature the bundle reads, naming all of them."""
        missing = sorted(set(self.manifest["features"]["inputs"]) - set(available))
        if missing:
            raise FeatureSchemaError(
                f"bundle {self.bundle_id} reads features {missing} that the input does not "
                f"have; it was trained on {self.manifest['training_data']['dataset']} with "
                f"inputs {self.manifest['features']['inputs']}")

    def predict(self, nodes: pd.DataFrame) -> pd.DataFrame:
        """Every node's `predicted_j` (plus `tree_pred_j`, the tree sum before the model-level
        regressor), with `self` rows added as in training."""
        self.check_features(nodes.columns)
        prep = prepare_nodes(nodes, self.leaf_spec.products(),
                             [*self.manifest["features"]["extensive"],
                              *self.leaf_spec.products()],
                             self.manifest["self_nodes"])
        index = TreeIndex.build(prep.tree_id.tolist(), prep.node_id.tolist(),
                                prep.parent_id.tolist())
        X = self.leaf_spec.matrix(prep)
        keys = choose_leaf_key(prep, self.leaves)
        check_leaf_coverage(prep, keys, index.is_leaf)
        leaf_pred = np.zeros(len(prep))
        for key in np.unique(keys):
            if not key:
                continue
            rows = keys == key
            leaf_pred[rows] = self._leaf(key, X[rows])
        if self._combiner is not None:
            Z = self.combiner_spec.matrix(prep)
            alpha = self._combiner.run(None, {"Z": Z})[0].reshape(-1)
        else:
            alpha = np.ones(len(prep))
        pred = index.aggregate(leaf_pred, alpha)
        out = prep.copy()
        out["tree_pred_j"] = pred
        if self._model_level is not None:
            share = index.path_weight(alpha) * pred
            Xc, roots = component_matrix(prep, index, share,
                                         self.manifest["model_level"]["components"])
            inner = ~index.is_leaf[roots]
            pred = pred.copy()
            if inner.any():
                y = self._model_level.run(None, {"X": Xc[inner]})[0]
                pred[roots[inner]] = np.asarray(y).reshape(-1)
        out["predicted_j"] = pred
        return out

    def _leaf(self, key: str, X: np.ndarray) -> np.ndarray:
        leaf = self.leaves[key]
        exposure = np.ones(len(X))
        if leaf["exposure"] is not None:
            j = leaf["exposure"]
            exposure = X[:, j]
            X = np.delete(X, j, axis=1)
        z = np.asarray(self._sessions[key].run(None, {"X": np.ascontiguousarray(X)})[0])
        z = z.reshape(-1)
        return np.exp(z) * exposure if leaf["target"] == "log" else z
