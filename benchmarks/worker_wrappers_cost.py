"""The worker's step-time wrappers on the engine loop's thread, per step: what they add when the
worker runs inside the engine core (vLLM 0.33's default process on one GPU: `UniProcExecutor`
calls the worker's methods on the loop's thread through `run_method`).

Played step after step as model runner V2 hands a step over: `execute_model(scheduler_output)`
returns nothing, `sample_tokens(grammar_output)` returns an async output, the loop waits
`--step-ms` for the device (a sleep: V2 waits on a blocking CUDA event, the GIL is free), then
calls the output's `get_output()`. Each call goes through vLLM's own `run_method`, to the
plugin's wrappers (`runtime/worker/step.py`) around stand-in methods, or to the bare stand-ins:
two lanes of steps, with the plugin and without, played in turns of 50 steps
(`tests/support/engine_loop.in_turns`), so each call meets what it meets in an engine, the same
calls step after step and the same wait. The figure is the median step's three calls with the
plugin minus without (the waits excluded), its 95 % CI bootstrapped.

Two step clocks (`--clocks`):
- `host`: a CPU worker's (`perf_counter_ns`);
- `cuda`: a GPU worker's, with stand-in events at `torch.cuda.Event` and
  `torch.cuda.current_stream` that do nothing. It times the plugin's own Python on a GPU's path;
  the CUDA calls themselves (recording an event) cannot be timed without a GPU and are not in it.

    .venv/bin/python benchmarks/worker_wrappers_cost.py --steps 2000 --json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
from engine_loop_cost import added, loop_options
from serve_overhead import ROOT, finish_run, header, json_option
from tqdm import tqdm

sys.path.insert(0, str(ROOT / "tests" / "support"))

from engine_loop import BLOCK, SETTLE, in_turns  # noqa: E402

from vllm_piep.runtime.worker.step import (  # noqa: E402
    _wrap_execute_model,
    _wrap_sample_tokens,
    read_step_time,
)


class AsyncOutput:
    """Model runner V2's `AsyncOutput`: holds the step's output, handed over once its tokens
    are back."""

    def __init__(self, req_ids: list[str]) -> None:
        self.model_runner_output = SimpleNamespace(req_ids=req_ids)

    def get_output(self) -> Any:
        return self.model_runner_output


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


class NoOpCudaEvent:
    """`torch.cuda.Event` as far as the step clock calls it, doing nothing: a step of 5 ms."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: Any) -> float:
        return 5.0


def use_clock(kind: str) -> None:
    """Workers made after this time their steps with the `kind` of clock."""
    BareWorker.device = "cuda" if kind == "cuda" else "cpu"
    if kind == "cuda":
        import torch

        stream = object()
        torch.cuda.Event = NoOpCudaEvent  # type: ignore[misc,assignment]
        torch.cuda.current_stream = lambda device=None: stream  # type: ignore[assignment]


def play(n: int, steps: int, step_ms: float) -> tuple[np.ndarray, np.ndarray]:
    """µs per step in the three calls (the wait excluded), with the plugin and without, played
    in turns (`in_turns`), but for the first turn."""
    from vllm.v1.serial_utils import run_method

    req_ids = [f"req-{i}" for i in range(n)]
    scheduler_output = SimpleNamespace(total_num_scheduled_tokens=n)
    clock = time.perf_counter_ns

    def lane(worker: BareWorker) -> Iterator[int]:
        for _ in range(steps):
            t0 = clock()
            run_method(worker, "execute_model", (scheduler_output,), {})
            output = run_method(worker, "sample_tokens", (None,), {})
            spent = clock() - t0
            time.sleep(step_ms / 1e3)  # the device computes the step
            t0 = clock()
            model_output = output.get_output()
            spent += clock() - t0
            if isinstance(worker, WrappedWorker) and read_step_time(model_output)[0] is None:
                raise SystemExit("the step's output came back without its step time")
            yield spent

    got = in_turns(steps, {True: lane(WrappedWorker(req_ids)), False: lane(BareWorker(req_ids))})
    first = BLOCK - SETTLE
    return (np.asarray(got[True][first:]) / 1e3, np.asarray(got[False][first:]) / 1e3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    loop_options(parser)
    parser.add_argument("--clocks", default="host,cuda",
                        help="step clocks to play: host, cuda (stand-in events), or both")
    json_option(parser, "worker_wrappers_cost.json")
    args = parser.parse_args()
    info = header("the worker's step-time wrappers on the engine loop's thread, µs per step")
    results: dict[str, Any] = {}
    runs = [(kind, int(b)) for kind in args.clocks.split(",") for b in args.batches.split(",")]
    for kind, n in tqdm(runs, desc="engine runs", unit="run"):
        use_clock(kind)
        gc.collect()
        plugin, bare = play(n, args.steps, args.step_ms)
        us, low, high = added(plugin, bare)
        # No mean over steps: a host hiccup of a few ms in one bare or wrapped call moves it
        # by more than the wrappers cost.
        results.setdefault(kind, {})[str(n)] = {
            "median_us": us, "ci95_us": [low, high],
            "median_us_with": float(np.median(plugin)),
            "median_us_without": float(np.median(bare)),
            "p90_us": float(np.percentile(plugin, 90) - np.percentile(bare, 90)),
            "steps": len(plugin)}
    print("\nthe worker's wrappers (execute_model, sample_tokens, the async output's "
          "get_output) on the engine loop's thread, µs per step, median with minus without "
          "(95 % CI), p90 with minus without:")
    for kind, by_batch in results.items():
        for n, r in by_batch.items():
            print(f"  {kind:>4} clock  batch {n:>4}  {r['median_us']:6.1f} "
                  f"({r['ci95_us'][0]:.1f}-{r['ci95_us'][1]:.1f})  p90 {r['p90_us']:6.1f}")
    finish_run(info, args, {"us_per_step": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
