"""ONNX bundle versus training-time prediction, side by side in one run.

Fits the default `TreePredictor` on IrEne's data without one model, exports it, and times
`TreeBundle.predict` (onnxruntime, one thread per session) against `TreePredictor.predict`
(scikit-learn) on the held-out model's trees, alternating A B B A so that the drifts of this
shared machine hit both alike. Two sizes: one tree (what a single forward pass needs) and all
held-out trees in one call. Reported: median milliseconds of each and the ratio ONNX /
training-time, plus the largest relative difference of their predictions.

    .venv/bin/python benchmarks/bundle_predict.py [--rounds 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_piep.calibrate.export import export_bundle  # noqa: E402
from vllm_piep.calibrate.train import TreePredictor  # noqa: E402
from vllm_piep.datasets.irene import load_irene  # noqa: E402
from vllm_piep.predict.bundle import TreeBundle  # noqa: E402


def timed(call) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(ROOT / "data" / "irene" / "device_1"))
    p.add_argument("--held-out", default="gpt2")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()

    ds = load_irene(args.data)
    train, test = ds.where_model([args.held_out], keep=False), ds.where_model([args.held_out])
    model = TreePredictor().fit(train)
    with tempfile.TemporaryDirectory() as tmp:
        export_bundle(model, train, tmp, hardware="irene/device_1", command="benchmark")
        bundle = TreeBundle.load(tmp)
        one = test.subset(test.trees.tree_id[:1])
        cases = {"one tree": one, f"{len(test.trees)} trees": test}
        out: dict[str, dict[str, float]] = {}
        for name, data in cases.items():
            onnx_ms, sk_ms = [], []
            for r in range(args.rounds):  # A B B A ...
                order = ("onnx", "sklearn") if r % 2 == 0 else ("sklearn", "onnx")
                for which in order:
                    if which == "onnx":
                        onnx_ms.append(timed(lambda: bundle.predict(data.nodes)))
                    else:
                        sk_ms.append(timed(lambda: model.predict(data)))
            got = bundle.predict(data.nodes).predicted_j.to_numpy()
            ref = model.predict(data).nodes.predicted_j.to_numpy()
            out[name] = {
                "nodes": int(len(data.nodes)),
                "onnx_ms_median": statistics.median(onnx_ms),
                "sklearn_ms_median": statistics.median(sk_ms),
                "ratio_onnx_over_sklearn": statistics.median(onnx_ms) / statistics.median(sk_ms),
                "max_relative_difference": float(np.max(np.abs(got - ref) / np.abs(ref))),
            }
    for name, r in out.items():
        print(f"{name:>10} ({r['nodes']} nodes): onnx {r['onnx_ms_median']:.2f} ms, "
              f"training-time {r['sklearn_ms_median']:.2f} ms, ratio "
              f"{r['ratio_onnx_over_sklearn']:.2f}, max rel. diff "
              f"{r['max_relative_difference']:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
