"""A tiny-Llama campaign's tree templates with known leaf coefficients: the synthetic ground
truth that tests/test_bundle_serving.py and tests/test_conformal.py train bundles on."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_piep.model.flops import ModelShape

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" /
                   "campaign_templates.json").read_text())
SHAPE = ModelShape(**DATA["shape"])
DEVICE = ("cpu", "Test CPU @ 1 GHz")
WAITS = {"tp2-pp1": {"all_reduce": 2e-4, "all_gather": 1e-4}}
IDLE = {"tp1-pp1": 10.0, "tp2-pp1": 14.0}
# Known leaf coefficients per type on SERVE_FEATURES (gflop, mem_mib, comm_mib, wait_s, calls,
# batch_size): what the trained leaves must recover.
TRUE = {
    "embedding": (0.0, 2e-3, 0, 0, 1e-4, 0),
    "attention": (0.4, 3e-3, 0, 0, 5e-4, 1e-5),
    "mlp": (0.3, 2e-3, 0, 0, 3e-4, 0),
    "attention_norm": (0.1, 1e-3, 0, 0, 1e-4, 0),
    "mlp_norm": (0.1, 1e-3, 0, 0, 1e-4, 0),
    "final_norm": (0.1, 1e-3, 0, 0, 1e-4, 0),
    "logits": (0.2, 2e-3, 0, 0, 2e-4, 0),
    "transfer": (0, 0, 0.05, 0, 4e-4, 0),
    "wait": (0, 0, 0, 20.0, 1e-5, 0),
    "overhead": (0, 0, 0, 0, 5e-3, 2e-4),
}
