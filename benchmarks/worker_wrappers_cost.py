"""The worker's step-time wrappers on the engine loop's thread, per step: what they add when the
worker runs inside the engine core (vLLM 0.33's default process on one GPU: `UniProcExecutor`
calls the worker's methods on the loop's thread through `run_method`).

Played step after step as model runner V2 hands a step over: `execute_model(scheduler_output)`
returns nothing, `sample_tokens(grammar_output)` returns an async output, the loop waits
`--step-ms` for the device (a sleep: the GIL is free), then calls the output's `get_output()`.
Each call goes through vLLM's own `run_method`, to the plugin's wrappers
(`runtime/worker/step.py`) around stand-in methods, and to the bare stand-ins just before:
the figure is wrapped minus bare, summed over the step's three calls, on the loop's thread.

The worker here is a CPU worker, so its step clock is the host's (`perf_counter_ns`). A GPU
worker's clock makes and records a CUDA event at the step's start and end instead; those CUDA
calls cannot be timed on a machine without a GPU and are not in these figures.

    .venv/bin/python benchmarks/worker_wrappers_cost.py --steps 2000 --json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
from engine_loop_cost import ci95, loop_options
from serve_overhead import ROOT, finish_run, header, json_option
from tqdm import tqdm

sys.path.insert(0, str(ROOT / "tests" / "support"))

from engine_loop import wrapped_minus_bare  # noqa: E402

from vllm_piep.runtime.worker.step import (  # noqa: E402
    STEP_NS_ATTR,
    _wrap_execute_model,
    _wrap_sample_tokens,
)


class AsyncOutput:
    """Model runner V2's `AsyncModelRunnerOutput`: the step's output once its tokens are back."""

    def __init__(self, req_ids: list[str]) -> None:
        self._output = SimpleNamespace(req_ids=req_ids)

    def get_output(self) -> Any:
        return self._output


class BareWorker:
    """vLLM's `Worker` as far as the wrappers see it: a device, and a step in two calls."""

    device = "cpu"

    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids

    def execute_model(self, scheduler_output: Any) -> Any:
        return None  # the step goes on in sample_tokens

    def sample_tokens(self, grammar_output: Any) -> Any:
        return AsyncOutput(self.req_ids)


class WrappedWorker(BareWorker):
    execute_model = _wrap_execute_model(BareWorker.execute_model)  # type: ignore[assignment]
    sample_tokens = _wrap_sample_tokens(BareWorker.sample_tokens)  # type: ignore[assignment]


def play(n: int, steps: int, step_ms: float) -> np.ndarray:
    """µs the wrappers add per step, after the first 50 steps."""
    from vllm.v1.serial_utils import run_method

    req_ids = [f"req-{i}" for i in range(n)]
    bare, wrapped = BareWorker(req_ids), WrappedWorker(req_ids)
    scheduler_output = SimpleNamespace(total_num_scheduled_tokens=n)
    costs = []
    timed = wrapped_minus_bare
    for _ in range(steps):
        cost, _ = timed(lambda: run_method(wrapped, "execute_model", (scheduler_output,), {}),
                        lambda: run_method(bare, "execute_model", (scheduler_output,), {}))
        bare_output = run_method(bare, "sample_tokens", (None,), {})
        sampled, output = timed(lambda: run_method(wrapped, "sample_tokens", (None,), {}),
                                lambda: run_method(bare, "sample_tokens", (None,), {}))
        time.sleep(step_ms / 1e3)  # the device computes the step
        got, model_output = timed(output.get_output, bare_output.get_output)
        if getattr(model_output, STEP_NS_ATTR, None) is None:
            raise SystemExit("the step's output came back without its step time")
        costs.append(cost + sampled + got)
    return np.asarray(costs[50:]) / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    loop_options(parser)
    json_option(parser, "worker_wrappers_cost.json")
    args = parser.parse_args()
    info = header("the worker's step-time wrappers on the engine loop's thread, µs per step")
    results: dict[str, Any] = {}
    for n in tqdm([int(b) for b in args.batches.split(",")], desc="engine runs", unit="run"):
        gc.collect()
        us = play(n, args.steps, args.step_ms)
        low, high = ci95(us)
        # No mean: a host hiccup of a few ms in one bare or wrapped call moves it by more
        # than the wrappers cost.
        results[str(n)] = {"median_us": float(np.median(us)), "ci95_us": [low, high],
                           "p90_us": float(np.percentile(us, 90)), "steps": len(us)}
    print("\nthe worker's wrappers (execute_model, sample_tokens, the async output's "
          "get_output) on the engine loop's thread, host step clock, µs per step, "
          "median (95 % CI) p90:")
    for n, r in results.items():
        print(f"  batch {n:>4}  {r['median_us']:6.1f} ({r['ci95_us'][0]:.1f}-"
              f"{r['ci95_us'][1]:.1f})  p90 {r['p90_us']:6.1f}")
    finish_run(info, args, {"us_per_step": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
