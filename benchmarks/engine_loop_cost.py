"""The plugin's time on the engine core's busy loop per step: on its critical path (a step's
output to the next dispatch) with the accounting queued (as served) against run inside the step
(as before, and as an in-process engine still does), side by side in one run.

In this process: vLLM's engine loop is played step after step with the plugin's real wrappers
of `Scheduler.schedule`, `get_grammar_bitmask`, `update_from_output` and `finish_requests`
around stand-in originals that hand back prebuilt scheduler states (a decode batch of `n`
requests with ~100 tokens of context, as `predictor_cost.py`; each step ~1 % of them end,
~0.25 % are aborted from outside, and as many new 32-token prompts join, so prefills, finishes
and aborts all occur), real vLLM `EngineCoreOutput(s)`, and a real output thread that
serializes each batch with vLLM's `MsgpackEncoder.encode_into` through the plugin's wrapper.
After schedule the loop calls get_grammar_bitmask (where vLLM calls it, right after dispatch),
then sleeps `--step-ms` (the GPU's time: the GIL is free, as while vLLM waits on the device),
then updates; with async scheduling the next step is scheduled before the update. The
predictor is the analytic prior of the tiny model, loaded as the engine loads it. Timed on the
loop thread, per step: schedule + update + finish (the critical path, the target) and
get_grammar_bitmask (the accounting, in the device's shadow: hidden while the loop's whole cycle
is shorter than the device step). The same steps run in two lanes, through the plugin's
wrappers and through the bare originals, in turns of 50 steps (`engine_loop.in_turns`), each
as an engine runs, the same calls step after step; the figure is the median step with the
plugin minus the median step without, with a bootstrapped 95 % CI (`added`). Measured
mode adds the engine meter's thread over the stand-in NVML counter
(`tests/support/standin_nvml.py`, 20 ms updates).

Prediction mode as served is sparse (`accountant.py`): steps are evaluated when an output that
finishes a request needs its row (or every `MAX_UNEVALUATED` steps), and only such outputs carry
one; it runs as a third placement, "queued, sparse". Timed for it besides: each evaluation of
the steps waiting (what a finishing output's batch can be held). Prediction mode also checks
that the dense placements attach byte-identical records to every output (the same calls in the
same order: only where and when they run moves), and the sparse one the same records to 1e-9 on
the outputs it gives rows (it predicts the steps waiting in one call, `StepGraph.run_many`,
whose sums round in another order).

Beside them, "floor": the loop played with `FloorWrappers`, the least any wrapper that queues
the step's work for later does (per wrapped call a dict lookup, a clock read, a deque append).
On a VM, code that runs right after the loop's wait on the device can run many times slower
than warm code, so the floor says what the machine makes of the critical path at that moment;
the target's verdict is on the plugin's absolute figure.

    .venv/bin/python benchmarks/engine_loop_cost.py --steps 2000 --json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
from predictor_cost import load_both
from serve_overhead import ROOT, finish_run, header, json_option, verdict
from tqdm import tqdm

sys.path.insert(0, str(ROOT / "tests" / "support"))

from engine_loop import BLOCK, SETTLE, PlayedEngine, Workload  # noqa: E402
from standin_nvml import meter as standin_meter  # noqa: E402

from vllm_piep.runtime.engine_core.accountant import EngineAccountant  # noqa: E402
from vllm_piep.runtime.engine_core.measured import EngineMeter  # noqa: E402

# The added CPU per step allowed on the loop's critical path, and in all (critical path,
# the device's shadow, the output thread, the meter thread), by batch and predictor.
PATH_TARGET_US = 20.0
TOTAL_TARGETS_US = {("prior", 64): 50.0, ("prior", 256): 100.0, ("bundle", 64): 150.0}


def play(predictor: Any, n: int, steps: int, step_ms: float, async_scheduling: bool,
         off_loop: bool, measured: bool, seed: int, sparse: bool = False,
         floor: bool = False, device_wait: Callable[[float], None] = time.sleep
         ) -> dict[str, Any]:
    """One engine run; µs of plugin time on the loop per step, on the output and meter
    threads, and what went out (`floor`: the least a queueing wrapper does instead of the
    plugin's, `FloorWrappers`; `device_wait(seconds)`: the loop's wait for the device)."""
    acc = EngineAccountant(lambda: predictor)
    acc.sparse = sparse
    evaluations: list[tuple[int, int]] = []  # (steps evaluated, ns)
    evaluate = acc.evaluate

    def timed_evaluate() -> None:
        waiting = acc._log_steps
        t0 = time.perf_counter_ns()
        evaluate()
        if waiting:
            evaluations.append((waiting, time.perf_counter_ns() - t0))

    acc.evaluate = timed_evaluate  # type: ignore[method-assign]
    engine = PlayedEngine(acc, Workload(n, seed), off_loop, int(step_ms * 1e6))
    engine_meter = None
    if measured:
        engine_meter = EngineMeter(acc, standin_meter, "standin", lambda: 10.0,
                                   engine.put_outputs)
        acc.engine_meter = engine_meter.start()
        deadline = time.monotonic() + 10
        while acc.splitter is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if acc.splitter is None:
            raise SystemExit("the stand-in meter did not open")
    meter_clock = (time.pthread_getcpuclockid(engine_meter._thread.ident)
                   if engine_meter is not None and engine_meter._thread is not None else None)
    meter_ns0 = time.clock_gettime_ns(meter_clock) if meter_clock is not None else 0
    wall0 = time.perf_counter_ns()
    times = engine.run(steps, async_scheduling, lambda: device_wait(step_ms / 1e3), floor)
    wall_ns = time.perf_counter_ns() - wall0
    meter_ns = (time.clock_gettime_ns(meter_clock) - meter_ns0) if meter_clock is not None else 0
    if engine_meter is not None:
        engine_meter.stop()
    engine.close()
    # The first turn loads the predictor: not counted.
    first = BLOCK - SETTLE
    us = {k: np.asarray(getattr(times, k)[first:]) / 1e3 for k in times._fields}
    output_ns = engine.output_thread_ns[BLOCK:steps]
    # The meter thread runs by the clock: its CPU per second of the run, per plugin step's
    # second (the lanes take turns, so the plugin's steps fill about half the run).
    plugin_s = (float(np.sum(us["plugin"]) + np.sum(us["plugin_shadow"])) / 1e6
                + len(us["plugin"]) * step_ms / 1e3)
    return {"us": us, "engine": engine, "total_joules": acc.total_joules,
            "tracked": acc.tracked_requests, "errors": acc.errors, "evaluations": evaluations,
            "output_thread_us": float(np.mean(output_ns)) / 1e3 if output_ns else 0.0,
            "meter_us": meter_ns / 1e3 / (wall_ns / 1e9) * plugin_s / len(us["plugin"])}


def rows_match(dense: PlayedEngine, sparse: PlayedEngine, rtol: float = 1e-9) -> bool:
    """Every row the sparse engine's outputs carried equals, field by field to `rtol`, the
    dense engine's on the same output (held or not), and only those outputs lack one that
    neither finish a request nor have stop strings."""
    ours, theirs = sparse.sent(), dense.sent()
    if ours.keys() != theirs.keys():
        return False
    for key, (_, row) in ours.items():
        if row is None:
            continue
        other = theirs[key][1]
        if other is None or not np.allclose(np.frombuffer(row, np.float64),
                                            np.frombuffer(other, np.float64),
                                            rtol=rtol, atol=1e-15):
            return False
    return True


def mean_added(plugin: np.ndarray, bare: np.ndarray, rounds: int = 2000, seed: int = 0
               ) -> tuple[float, float, float]:
    """What the plugin adds per step on average (its sparse evaluations amortized): the mean
    with it minus the mean without, and the difference's bootstrapped 95 % CI."""
    rng = np.random.default_rng(seed)
    diffs = (rng.choice(plugin, size=(rounds, len(plugin))).mean(axis=1)
             - rng.choice(bare, size=(rounds, len(bare))).mean(axis=1))
    return (float(plugin.mean() - bare.mean()),
            float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5)))


def ci95(values: np.ndarray, rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, size=(rounds, len(values))), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def added(plugin: np.ndarray, bare: np.ndarray, rounds: int = 2000, seed: int = 0
          ) -> tuple[float, float, float]:
    """What the plugin adds per step: the median with it minus the median without, and the
    difference's bootstrapped 95 % CI."""
    rng = np.random.default_rng(seed)
    diffs = (np.median(rng.choice(plugin, size=(rounds, len(plugin))), axis=1)
             - np.median(rng.choice(bare, size=(rounds, len(bare))), axis=1))
    return (float(np.median(plugin) - np.median(bare)),
            float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5)))


def loop_options(parser: argparse.ArgumentParser) -> None:
    """The played engine loop's options, shared by the benchmarks that play it."""
    parser.add_argument("--batches", default="64,256", help="requests per step (default 64,256)")
    parser.add_argument("--steps", type=int, default=2000, help="engine steps per run")
    parser.add_argument("--step-ms", type=float, default=5.0,
                        help="the device's time per step (default 5 ms, a GPU decode step)")


# (predictor, mode, placement): the engine runs of each batch and schedule. "served" is the
# engine core as served (queued off the loop, sparse); "inside step"/"queued" are the dense
# engine (in-process `LLM`), run inside the step and queued, for the records' check.
CELLS = [("prior", "predicted", "inside step"), ("prior", "predicted", "queued"),
         ("prior", "predicted", "served"), ("prior", "measured", "served"),
         ("bundle", "predicted", "inside step"), ("bundle", "predicted", "served"),
         ("none", "floor", "queued")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "tiny-llama")
    parser.add_argument("--bundle", type=Path, default=ROOT / "models" / "cpu-tiny-llama")
    loop_options(parser)
    json_option(parser, "engine_loop_cost.json")
    args = parser.parse_args()
    info = header("plugin CPU per engine step: critical path, device's shadow, output and "
                  "meter threads")
    predictors = load_both(args.model, args.bundle)
    batches = [int(b) for b in args.batches.split(",")]
    cells = [(n, sched, *cell) for n in batches for sched in ("sync", "async") for cell in CELLS]
    results: dict[str, Any] = {}
    identical: dict[str, bool] = {}
    engines: dict[tuple, PlayedEngine] = {}
    for n, sched, pred, mode, placement in tqdm(cells, desc="engine runs", unit="run"):
        # The earlier cells' records stay in memory; frozen, the collector no longer walks
        # them (a full collection over them took up to 0.5 s, inside whichever call it hit).
        gc.collect()
        gc.freeze()
        run = play(predictors.get(pred), n, args.steps, args.step_ms, sched == "async",
                   placement != "inside step", mode == "measured", seed=n,
                   sparse=placement == "served", floor=mode == "floor")
        us = run["us"]
        median, low, high = added(us["plugin"], us["bare"])
        loop_plugin = us["plugin"] + np.resize(us["plugin_shadow"], len(us["plugin"]))
        loop_bare = us["bare"] + np.resize(us["bare_shadow"], len(us["bare"]))
        loop_mean, loop_low, loop_high = mean_added(loop_plugin, loop_bare)
        threads = run["output_thread_us"] + run["meter_us"]
        key = f"{n}/{pred}/{mode}/{sched}/{placement}"
        results[key] = {"path_median_us": median, "path_ci95_us": [low, high],
                        "path_p90_us": float(np.percentile(us["plugin"], 90)
                                             - np.percentile(us["bare"], 90)),
                        "loop_mean_us": loop_mean, "loop_ci95_us": [loop_low, loop_high],
                        "output_thread_us": run["output_thread_us"],
                        "meter_thread_us": run["meter_us"],
                        "total_us": loop_mean + threads,
                        "total_ci95_us": [loop_low + threads, loop_high + threads],
                        "shadow_median_us": added(us["plugin_shadow"], us["bare_shadow"])[0],
                        "steps": len(us["plugin"]), "tracked_after": run["tracked"],
                        "errors": run["errors"]}
        if run["evaluations"]:
            waited = np.array([w for w, _ in run["evaluations"]])
            ms = np.array([t for _, t in run["evaluations"]]) / 1e6
            results[key]["evaluations"] = {
                "count": len(ms), "steps_median": float(np.median(waited)),
                "ms_median": float(np.median(ms)), "ms_p99": float(np.percentile(ms, 99)),
                "ms_max": float(ms.max()), "us_per_step": float(ms.sum() * 1e3 / waited.sum())}
        if mode == "predicted":
            engines[(n, sched, pred, placement)] = run["engine"]
    for n in batches:
        for sched in ("sync", "async"):
            dense = engines[(n, sched, "prior", "inside step")]
            identical[f"{n}/{sched}/prior/queued"] = (
                dense.rows == engines[(n, sched, "prior", "queued")].rows)
            for pred in ("prior", "bundle"):
                identical[f"{n}/{sched}/{pred}/served"] = rows_match(
                    engines[(n, sched, pred, "inside step")], engines[(n, sched, pred, "served")])
    print(f"\nplugin µs per engine step (device step {args.step_ms} ms). Critical path: "
          "median (95 % CI), the step's output to the next dispatch. Total: mean (95 % CI) "
          "of the loop's critical path and its work in the device's shadow, plus the output "
          "thread's and the meter thread's plugin CPU per step: every µs the plugin adds to "
          "the engine core, its sparse evaluations amortized. 'floor': the least a wrapper "
          "that queues the step's work costs here:")
    floor_of = {f"{k.split('/')[0]}/{k.split('/')[3]}": r for k, r in results.items()
                if "/floor/" in k}
    for key, r in results.items():
        n, pred, mode, sched, placement = key.split("/")
        floor = floor_of.get(f"{n}/{sched}")
        marks = ""
        if placement == "served":
            path = r["path_median_us"]
            marks = f"  path ≤ {PATH_TARGET_US:.0f}: {verdict(path <= PATH_TARGET_US)}"
            if floor is not None:
                marks += f" ({path - floor['path_median_us']:+.1f} above the floor)"
            target = TOTAL_TARGETS_US.get((pred, int(n)))
            if target is not None:
                marks += f"; total ≤ {target:.0f}: {verdict(r['total_us'] <= target)}"
        print(f"  {key:<40} path {r['path_median_us']:6.1f} ({r['path_ci95_us'][0]:.1f}-"
              f"{r['path_ci95_us'][1]:.1f})  total {r['total_us']:7.1f} "
              f"({r['total_ci95_us'][0]:.1f}-{r['total_ci95_us'][1]:.1f}; output thread "
              f"{r['output_thread_us']:.1f}, meter {r['meter_thread_us']:.1f}){marks}")
        if "evaluations" in r:
            e = r["evaluations"]
            print(f"    {e['count']} passes over the log (median {e['steps_median']:.0f} "
                  f"steps): {e['ms_median']:.2f} ms median, {e['ms_p99']:.2f} p99, "
                  f"{e['ms_max']:.2f} max; {e['us_per_step']:.0f} µs per step evaluated")
    for key, same in identical.items():
        alike = "byte-identical" if key.endswith("/queued") else "equal to 1e-9 per output"
        print(f"records, the dense engine inside the step vs {key}: "
              f"{alike if same else 'DIFFERENT'}")
    finish_run(info, args, {"us_per_step": results, "records_identical": identical,
                            "path_target_us": PATH_TARGET_US,
                            "total_targets_us": {f"{p}/{n}": t
                                                 for (p, n), t in TOTAL_TARGETS_US.items()}})
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
