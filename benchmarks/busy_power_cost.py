"""What the prior's busy power costs per engine step, side by side in one run.

Times, in this process, the three per-step calls that carry it, for an H100 prior of a
Llama-3.1-8B-shaped model with its fitted busy power and for the same prior without it (busy
powers at 0 W: no `BusyPower` in its step graph): the engine core's folded decode step
(`SplitRule.decode_step`), the explicit split's coefficients (`SplitRule.coefficients`) and the
ONNX step graph (`StepGraph.run`, the reference and the dense path), at decode batches of 64 and
256. The calls take turns in every repeat; the added µs per call is the median with busy power
minus the median without, with a bootstrapped 95 % CI (`engine_loop_cost.added`).

    .venv/bin/python benchmarks/busy_power_cost.py --repeats 5000 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_loop_cost import added  # noqa: E402
from serve_overhead import finish_run, header, json_option  # noqa: E402

from vllm_piep.model.devices import GPU_SPECS, DeviceProfile  # noqa: E402
from vllm_piep.model.flops import ModelShape, StepBatch  # noqa: E402
from vllm_piep.predict.prior import PriorPredictor  # noqa: E402
from vllm_piep.predict.split_rule import DECODE_U, DECODE_V, SplitRule  # noqa: E402
from vllm_piep.predict.stepgraph import raw_inputs  # noqa: E402

SHAPE = ModelShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                   head_dim=128, vocab=128256, dtype_bytes=2)
CONTEXT = 1000.0
STEP_S = 0.02


def calls(prior: PriorPredictor, n: int) -> dict[str, Callable[[], Any]]:
    rule = SplitRule(prior.graph.spec)
    sched, prompt = raw_inputs(StepBatch.from_lists([0] * n, [1] * n, [CONTEXT] * n, [1] * n))
    context = n * CONTEXT
    sums = n * DECODE_U + context * DECODE_V
    return {"decode step": lambda: rule.decode_step(n, context, STEP_S),
            "coefficients": lambda: rule.coefficients(sums, STEP_S),
            "step graph": lambda: prior.graph.run(sched, prompt, STEP_S)}


def timed(lanes: dict[str, dict[str, Callable[[], Any]]], repeats: int
          ) -> dict[str, dict[str, np.ndarray]]:
    """µs per call of each lane's calls, all taking turns in every repeat."""
    clock = time.perf_counter_ns
    out: dict[str, dict[str, list[int]]] = {lane: {c: [] for c in fs} for lane, fs in
                                            lanes.items()}
    for i in range(repeats + repeats // 10):
        for lane, fs in lanes.items():
            for name, call in fs.items():
                t0 = clock()
                call()
                if i >= repeats // 10:  # the first tenth warms up
                    out[lane][name].append(clock() - t0)
    return {lane: {c: np.asarray(v) / 1e3 for c, v in fs.items()} for lane, fs in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5000, help="timed calls per cell")
    parser.add_argument("--batches", default="64,256", help="decode batch sizes")
    json_option(parser, "busy_power_cost.json")
    args = parser.parse_args()
    info = header("busy power: added cost per engine step")
    profile = DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], SHAPE.dtype_bytes)
    without = dataclasses.replace(profile, run_watts=0.0, occupancy_watts=0.0)
    priors = {"busy": PriorPredictor(SHAPE, profile), "none": PriorPredictor(SHAPE, without)}
    assert priors["busy"].graph.spec.busy is not None and priors["none"].graph.spec.busy is None
    results: dict[str, Any] = {}
    for n in (int(b) for b in args.batches.split(",")):
        us = timed({lane: calls(p, n) for lane, p in priors.items()}, args.repeats)
        for name in us["busy"]:
            median, low, high = added(us["busy"][name], us["none"][name])
            results[f"{n}/{name}"] = {
                "with_us": statistics.median(us["busy"][name].tolist()),
                "without_us": statistics.median(us["none"][name].tolist()),
                "added_us": median, "added_ci95_us": [low, high]}
            r = results[f"{n}/{name}"]
            print(f"batch {n:>4} {name:<13} {r['without_us']:6.1f} -> {r['with_us']:6.1f} µs "
                  f"(added {median:+.1f}, 95 % CI {low:+.1f} to {high:+.1f})")
    finish_run(info, args, {"per_call": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
