"""The steps a sparse engine evaluates together: K steps in one `StepGraph.run_many` call versus
K onnxruntime calls (`StepGraph.run`, one per step), side by side in one run.

For the analytic prior and the shipped calibrated bundle, loaded as the plugin loads them, and
decode batches of 64, 128 and 256 requests (context ~100 tokens) with K = 1, 4 and 16 steps
waiting (`MAX_UNEVALUATED` is 16): each repeat times both ways in turn (so drifts of this
shared machine hit both alike), after a warm-up. Reported: medians in µs per evaluation, the
ratio one call / K calls per repeat (median and 95 % bootstrap CI), and the largest relative
difference between the two ways' outputs (they must agree to rounding).

    .venv/bin/python benchmarks/many_steps_cost.py --json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from engine_loop_cost import ci95
from predictor_cost import load_both
from serve_overhead import ROOT, finish_run, header, json_option
from tqdm import tqdm


def steps_of(n: int, k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`k` decode steps of `n` requests: (`sched` [4, n], `prompt` [1, n]) each."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(k):
        start = rng.integers(90, 111, n).astype(np.float64)
        prompt = np.full(n, 32.0)
        steps.append((np.vstack([start, np.ones(n), start - prompt, np.ones(n)]), prompt[None]))
    return steps


def compare(graph: Any, n: int, k: int, repeats: int, warmup: int) -> dict[str, Any]:
    steps = steps_of(n, k, seed=n * 100 + k)
    seconds = np.full(k, 0.005)
    sched = np.concatenate([s for s, _ in steps], axis=1)
    prompt = np.concatenate([p[0] for _, p in steps])
    starts = np.arange(k) * n

    def one_call() -> tuple[np.ndarray, np.ndarray]:
        return graph.run_many(sched, prompt, seconds, starts)

    def k_calls() -> list[tuple[np.ndarray, np.ndarray]]:
        return [graph.run(s, p, 0.005) for s, p in steps]

    together, joules = one_call()
    alone = k_calls()
    diff = max(float(np.max(np.abs(together[:, i * n:(i + 1) * n] - r) / np.abs(r).clip(1e-300)))
               for i, (r, _) in enumerate(alone))
    diff = max(diff, max(float(np.max(np.abs(joules[:, i] - j) / np.abs(j).clip(1e-300)))
                         for i, (_, j) in enumerate(alone)))
    times: dict[str, list[int]] = {"one call": [], "k calls": []}
    for r in range(warmup + repeats):
        for name, call in (("one call", one_call), ("k calls", k_calls)):
            t0 = time.perf_counter_ns()
            call()
            if r >= warmup:
                times[name].append(time.perf_counter_ns() - t0)
    one, many = np.asarray(times["one call"]) / 1e3, np.asarray(times["k calls"]) / 1e3
    ratio = one / many
    lo, hi = ci95(ratio)
    return {"one_call_us": float(np.median(one)), "k_calls_us": float(np.median(many)),
            "ratio": float(np.median(ratio)), "ratio_ci95": [lo, hi], "max_rel_diff": diff}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "tiny-llama")
    parser.add_argument("--bundle", type=Path, default=ROOT / "models" / "cpu-tiny-llama")
    parser.add_argument("--batches", default="64,128,256")
    parser.add_argument("--steps", default="1,4,16", help="steps evaluated together (K)")
    parser.add_argument("--repeats", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    json_option(parser, "many_steps_cost.json")
    args = parser.parse_args()
    info = header("K steps in one run_many call vs K step-graph calls")
    predictors = load_both(args.model, args.bundle)
    cells = [(name, int(n), int(k)) for name in predictors for n in args.batches.split(",")
             for k in args.steps.split(",")]
    results: dict[str, Any] = {}
    for name, n, k in tqdm(cells, desc="cells", unit="cell"):
        results[f"{name}/{n}/{k}"] = compare(predictors[name].graph, n, k, args.repeats,
                                             args.warmup)
    print("µs per evaluation of K waiting steps, median; one run_many call / K graph calls, "
          "median of repeats (95 % CI); largest relative difference of the outputs:")
    for key, r in results.items():
        print(f"  {key:<18} one call {r['one_call_us']:8.1f}  K calls {r['k_calls_us']:8.1f}  "
              f"ratio {r['ratio']:.3f} ({r['ratio_ci95'][0]:.3f}-{r['ratio_ci95'][1]:.3f})  "
              f"max rel diff {r['max_rel_diff']:.1e}")
    finish_run(info, args, {"cells": results})
    return 0 if all(r["max_rel_diff"] < 1e-9 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
