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

Prediction mode as served is sparse (`accounting.py`): steps are evaluated when an output that
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
from typing import Any

import numpy as np
from predictor_cost import tiny_shape
from serve_overhead import ROOT, finish_run, header, json_option, verdict
from tqdm import tqdm

sys.path.insert(0, str(ROOT / "tests" / "support"))

from engine_loop import BLOCK, SETTLE, PlayedEngine, Workload  # noqa: E402
from standin_nvml import meter as standin_meter  # noqa: E402

from vllm_piep.config import PiepConfig  # noqa: E402
from vllm_piep.predict.loader import load_predictor  # noqa: E402
from vllm_piep.runtime.engine_core.accounting import EngineAccountant  # noqa: E402
from vllm_piep.runtime.engine_core.measured import EngineMeter  # noqa: E402

TARGETS_US = {64: 20.0, 256: 40.0}


def play(predictor: Any, n: int, steps: int, step_ms: float, async_scheduling: bool,
         off_loop: bool, measured: bool, seed: int, sparse: bool = False,
         floor: bool = False) -> dict[str, Any]:
    """One engine run; µs of plugin time on the loop per step, and what went out (`floor`:
    the least a queueing wrapper does instead of the plugin's, `FloorWrappers`)."""
    acc = EngineAccountant(lambda: predictor)
    acc.sparse = sparse
    evaluations: list[tuple[int, int]] = []  # (steps evaluated, ns)
    evaluate = acc.evaluate

    def timed_evaluate() -> None:
        waiting = len(acc._done)
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
    times = engine.run(steps, async_scheduling, lambda: time.sleep(step_ms / 1e3), floor)
    if engine_meter is not None:
        engine_meter.stop()
    engine.close()
    # The first turn loads the predictor: not counted.
    first = BLOCK - SETTLE
    us = {k: np.asarray(getattr(times, k)[first:]) / 1e3 for k in times._fields}
    picked = [engine.picked(b) for b in range(len(engine.rows))]
    return {"us": us, "rows": engine.rows, "picked": picked,
            "total_joules": acc.total_joules, "tracked": acc.tracked_requests,
            "errors": acc.errors, "evaluations": evaluations}


def picked_rows(rows: list[bytes], picked: list[list[int]]) -> list[bytes]:
    """A dense run's rows at the outputs a sparse run gave rows (`PlayedEngine.picked`)."""
    from vllm_piep.runtime.record import ROW_BYTES

    return [b"".join(block[i * ROW_BYTES:(i + 1) * ROW_BYTES] for i in positions)
            for block, positions in zip(rows, picked, strict=True)]


def rows_match(a: list[bytes], b: list[bytes], rtol: float = 1e-9) -> bool:
    """The same blocks, field by field, to `rtol`."""
    return len(a) == len(b) and all(
        len(x) == len(y) and np.allclose(np.frombuffer(x, np.float64),
                                         np.frombuffer(y, np.float64), rtol=rtol, atol=1e-15)
        for x, y in zip(a, b, strict=True))


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "tiny-llama")
    loop_options(parser)
    json_option(parser, "engine_loop_cost.json")
    args = parser.parse_args()
    info = header("plugin µs per step on the engine loop: accounting queued vs inside the step")
    shape, arch = tiny_shape(args.model)
    predictor = load_predictor(PiepConfig(), shape, "cpu", None, arch)
    batches = [int(b) for b in args.batches.split(",")]
    cells = [(n, mode, sched, placement) for n in batches for mode in ("predicted", "measured")
             for sched in ("sync", "async") for placement in ("inside step", "queued",
                                                             "queued, sparse")
             if mode == "predicted" or placement != "queued, sparse"]
    cells += [(n, "floor", sched, "queued") for n in batches for sched in ("sync", "async")]
    results: dict[str, Any] = {}
    identical: dict[str, bool] = {}
    rows_by: dict[tuple, list[bytes]] = {}
    for n, mode, sched, placement in tqdm(cells, desc="engine runs", unit="run"):
        # The earlier cells' records stay in memory; frozen, the collector no longer walks
        # them (a full collection over them took up to 0.5 s, inside whichever call it hit).
        gc.collect()
        gc.freeze()
        run = play(predictor, n, args.steps, args.step_ms, sched == "async",
                   placement != "inside step", mode == "measured", seed=n,
                   sparse=placement == "queued, sparse", floor=mode == "floor")
        us = run["us"]
        median, low, high = added(us["plugin"], us["bare"])
        key = f"{n}/{mode}/{sched}/{placement}"
        results[key] = {"median_us": median, "ci95_us": [low, high],
                        "median_us_with": float(np.median(us["plugin"])),
                        "median_us_without": float(np.median(us["bare"])),
                        "p90_us": float(np.percentile(us["plugin"], 90)
                                        - np.percentile(us["bare"], 90)),
                        "mean_us": float(us["plugin"].mean() - us["bare"].mean()),
                        "shadow_median_us": added(us["plugin_shadow"], us["bare_shadow"])[0],
                        "shadow_mean_us": float(us["plugin_shadow"].mean()
                                                - us["bare_shadow"].mean()),
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
            rows_by[(n, sched, placement)] = run["rows"]
            if placement == "queued, sparse":
                rows_by[(n, sched, "picked")] = run["picked"]
    for n in batches:
        for sched in ("sync", "async"):
            a, b = rows_by[(n, sched, "inside step")], rows_by[(n, sched, "queued")]
            identical[f"{n}/{sched}"] = a == b
            sparse = rows_by[(n, sched, "queued, sparse")]
            identical[f"{n}/{sched}/sparse"] = rows_match(
                picked_rows(a, rows_by[(n, sched, "picked")]), sparse)
    print(f"\nplugin µs per step on the engine loop's critical path (device step "
          f"{args.step_ms} ms), median (95 % CI) p90 mean; and on the loop after the next step "
          "was dispatched, while the device computes it. 'floor': this machine's floor, the "
          "least a wrapper that queues the step's work costs here (a dict lookup, a clock read "
          "and a deque append per wrapped call; nothing accounted):")
    for key, r in results.items():
        n, mode, sched = key.split("/")[:3]
        target = TARGETS_US.get(int(n))
        floor = results.get(f"{n}/floor/{sched}/queued")
        mark = "" if target is None or "inside step" in key or mode == "floor" else (
            f"  target {target:.0f}: {verdict(r['median_us'] <= target)}"
            + ("" if floor is None else
               f" ({r['median_us'] - floor['median_us']:+.1f} above the floor)"))
        print(f"  {key:<32} {r['median_us']:7.1f} ({r['ci95_us'][0]:.1f}-{r['ci95_us'][1]:.1f})"
              f"  p90 {r['p90_us']:7.1f}  mean {r['mean_us']:7.1f}  in the device's shadow: "
              f"median {r['shadow_median_us']:6.1f} mean {r['shadow_mean_us']:6.1f}{mark}")
        if "evaluations" in r:
            e = r["evaluations"]
            print(f"    {e['count']} evaluations of the steps waiting (median "
                  f"{e['steps_median']:.0f} steps): {e['ms_median']:.2f} ms median, "
                  f"{e['ms_p99']:.2f} p99, {e['ms_max']:.2f} max; {e['us_per_step']:.0f} µs "
                  "per step evaluated")
    for key, same in identical.items():
        alike = "equal to 1e-9" if key.endswith("/sparse") else "byte-identical"
        print(f"records attached, inside the step vs queued (/sparse: at its picks), "
              f"batch/schedule {key}: {alike if same else 'DIFFERENT'}")
    finish_run(info, args, {"us_per_step": results, "records_identical": identical,
                            "targets_us": TARGETS_US})
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
