"""The predictor's cost per engine step, against the engine step it rides on, in one run.

Times, in this process, the call the engine core makes once per step: `predict_step` of the
step's batch followed by `attribution.split_step`, for (a) the analytic prior and (b) the shipped
calibrated bundle `models/cpu-tiny-llama` (TP 1), both loaded through
`predict.loader.load_predictor` as the plugin loads them; and the whole per-step engine work of
the plugin, `EngineAccountant.on_schedule` + `on_step_done` (prediction, split, running totals),
with each predictor. Where a predictor has a `run_step` (one onnxruntime call that predicts and
splits), the accountant calls that instead of `predict_step` + `split_step`: its columns are then
the engine's actual per-step cost (plus turning the `StepBatch` into scheduler numbers, which the
served hook hands over directly), and the header says which path each predictor takes.
Decode batches of 1, 16, 64 and 256 requests, each with a context of about 100 tokens; the
four callables are timed in turn within every repeat (so drifts of this shared machine hit all
alike), after a warm-up; medians (and 90th percentiles) in µs.

The step time they are compared with is measured in the same run: the tiny model served with
`--plugins piep` under a closed-loop decode load of `--step-batch` streams (16), mean engine step
= wall time / engine steps (`vllm:iteration_tokens_total_count`, one sample per step) over a
window; `--step-ms` skips the server. Target: the predictor <= 20 µs per step at batch 64.

    .venv/bin/python benchmarks/predictor_cost.py --model .cache/tiny-llama --repeats 3000 --json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_overhead import (  # noqa: E402
    RESULTS,
    ROOT,
    finish_run,
    header,
    http_client,
    json_option,
    metric_total,
    serving,
    stream_one,
    verdict,
    workload,
)

from vllm_piep.config import PiepConfig  # noqa: E402
from vllm_piep.model.flops import ModelShape, StepBatch  # noqa: E402
from vllm_piep.predict.attribution import split_step  # noqa: E402
from vllm_piep.predict.base import Predictor, StepInput  # noqa: E402
from vllm_piep.predict.loader import load_predictor  # noqa: E402
from vllm_piep.runtime.engine_core.accountant import EngineAccountant  # noqa: E402
from vllm_piep.tools.server import (  # noqa: E402
    ServerError,
    ServerOptions,
    exit_on_sigterm,
)

TARGET_US = 20.0
TARGET_BATCH = 64
STEP_METRIC = "vllm:iteration_tokens_total"


# --------------------------------------------------------------------------- predictors
def tiny_shape(model: Path) -> tuple[ModelShape, str | None]:
    """The served model's shape (float32, as `ServerOptions` serves it; TP 1) and architecture,
    from its config.json: what the engine hook gives `load_predictor`."""
    cfg = json.loads((model / "config.json").read_text())
    return ModelShape.from_hf_config(cfg, dtype_bytes=4), (cfg.get("architectures") or [None])[0]


def load_both(model: Path, bundle: Path) -> dict[str, Predictor]:
    shape, arch = tiny_shape(model)
    prior = load_predictor(PiepConfig(), shape, "cpu", None, arch)
    calibrated = load_predictor(PiepConfig(bundle=str(bundle)), shape, "cpu", None, arch)
    if calibrated.source == "prior":  # the loader fell back to the prior: say so, loudly
        raise SystemExit(f"bundle {bundle} did not load for {model} on this CPU (the loader "
                         "fell back to the prior; its warning above says why)")
    return {"prior": prior, "bundle": calibrated}


def engine_path(predictor: Predictor) -> str:
    """Which call the accountant makes per step with this predictor (only a label: the
    accountant columns time whatever it does)."""
    if callable(getattr(predictor, "run_step", None)):
        return "the engine calls its run_step (the predictor columns time predict_step + split)"
    return "the engine calls predict_step + split_step"


def decode_batch(n: int, seed: int = 0) -> tuple[list[str], StepBatch]:
    """`n` requests decoding one token each, with a context of 90-110 tokens."""
    rng = random.Random(seed)
    return ([f"req-{i}" for i in range(n)],
            StepBatch.from_rows([(0, 1, rng.randint(90, 110), 1) for _ in range(n)]))


def predictor_call(predictor: Predictor, batch: StepBatch, step_s: float) -> Callable[[], None]:
    step = StepInput(batch, step_s)

    def call() -> None:  # the predictor's per-step work without a step graph
        split_step(predictor.predict_step(step))

    return call


def accountant_call(predictor: Predictor, req_ids: list[str], batch: StepBatch,
                    step_ns: int) -> Callable[[], None]:
    acc = EngineAccountant(lambda: predictor)
    key = 0

    def call() -> None:  # one engine step: scheduled, then its output back
        nonlocal key
        key += 1
        acc.on_schedule(key, req_ids, batch)
        acc.on_step_done(key, step_ns)

    return call


def time_calls(calls: dict[str, Callable[[], None]], repeats: int, warmup: int
               ) -> dict[str, dict[str, float]]:
    """Median and p90 µs of each call, the calls taking turns in every repeat."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    samples: dict[str, list[int]] = {name: [] for name in calls}
    clock = time.perf_counter_ns
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = clock()
            call()
            samples[name].append(clock() - t0)
    return {name: {"median_us": statistics.median(s) / 1e3,
                   "p90_us": statistics.quantiles(s, n=10)[-1] / 1e3}
            for name, s in samples.items()}


def time_all(predictors: dict[str, Predictor], batches: list[int], repeats: int, warmup: int,
             step_s: float) -> dict[int, dict[str, dict[str, float]]]:
    out = {}
    for n in tqdm(batches, desc="predictor timing", unit="batch"):
        req_ids, batch = decode_batch(n)
        calls: dict[str, Callable[[], None]] = {}
        for name, p in predictors.items():
            calls[f"{name} predictor"] = predictor_call(p, batch, step_s)
        for name, p in predictors.items():
            calls[f"accountant ({name})"] = accountant_call(p, req_ids, batch,
                                                            int(step_s * 1e9))
        out[n] = time_calls(calls, repeats, warmup)
    return out


# --------------------------------------------------------------------------- step time
async def closed_loop(base_url: str, streams: int, warmup_s: float, window_s: float,
                      max_tokens: int) -> dict[str, float]:
    """Keep `streams` requests decoding (a new one as each ends) and read /metrics around a
    window once the batch is full: mean step = window wall time / engine steps in it."""
    stop = False
    # Far more than a window uses; cycling after that only meets the prefix cache.
    bodies = itertools.cycle(workload(5000, seed=7, max_tokens=max_tokens,
                                      prompt_tokens=(24, 40)))
    gaps: list[float] = []
    window = [float("inf"), float("inf")]  # set once the batch is full
    async with http_client(base_url, streams) as client:
        async def worker() -> None:
            while not stop:
                s = await stream_one(client, next(bodies))
                if s.mean_gap_s is not None and window[0] <= time.perf_counter() <= window[1]:
                    gaps.append(s.mean_gap_s)

        async def metrics() -> tuple[float, float, float]:
            text = (await client.get("/metrics")).text
            return (time.perf_counter(), metric_total(text, STEP_METRIC + "_count"),
                    metric_total(text, STEP_METRIC + "_sum"))

        tasks = [asyncio.create_task(worker()) for _ in range(streams)]
        await asyncio.sleep(warmup_s)
        t0, steps0, tokens0 = await metrics()
        window[0] = t0
        await asyncio.sleep(window_s)
        t1, steps1, tokens1 = await metrics()
        window[1] = t1
        stop = True
        await asyncio.gather(*tasks)
    steps = steps1 - steps0
    return {"step_ms": 1e3 * (t1 - t0) / steps, "steps": steps, "window_s": t1 - t0,
            "tokens_per_step": (tokens1 - tokens0) / steps,
            # cross-check: streams that ended inside the window, their mean inter-chunk gap
            "client_itl_ms": 1e3 * statistics.fmean(gaps) if gaps else float("nan")}


def measure_step(model: str, streams: int, window_s: float, max_tokens: int) -> dict[str, float]:
    with serving(ServerOptions(model=model, plugin="flag"),
                 RESULTS / "predictor_cost_server.log") as server:
        with tqdm(total=1, desc=f"step time at batch {streams}", unit="window") as bar:
            # Warm-up: long enough for every stream to be past its first prefill.
            out = asyncio.run(closed_loop(server.base_url, streams, warmup_s=5.0,
                                          window_s=window_s, max_tokens=max_tokens))
            bar.update()
    return out


# --------------------------------------------------------------------------- report
def print_table(costs: dict[int, dict[str, dict[str, float]]], step_ms: float) -> None:
    columns = list(next(iter(costs.values())))
    print(f"\nµs per engine step, median (p90), and as % of a mean step of {step_ms:.2f} ms:")
    print("batch | " + " | ".join(f"{c:>26}" for c in columns))
    for n, row in costs.items():
        cells = [f"{row[c]['median_us']:8.1f} ({row[c]['p90_us']:7.1f}) "
                 f"{100 * row[c]['median_us'] / 1e3 / step_ms:5.2f} %" for c in columns]
        print(f"{n:>5} | " + " | ".join(f"{x:>26}" for x in cells))


def verdicts(costs: dict[int, dict[str, dict[str, float]]]) -> dict[str, str]:
    row = costs.get(TARGET_BATCH)
    if row is None:
        return {}
    out = {c: verdict(v["median_us"] <= TARGET_US) for c, v in row.items()}
    print(f"\ntarget: predictor <= {TARGET_US:.0f} µs per step at batch {TARGET_BATCH} "
          "(median; the accountant columns include the predictor, shown against the same "
          "figure):")
    for c, v in out.items():
        print(f"  {c:<22} {row[c]['median_us']:8.1f} µs  {v}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--bundle", default=str(ROOT / "models" / "cpu-tiny-llama"))
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=3000, help="timed calls per cell")
    parser.add_argument("--warmup", type=int, default=300, help="untimed calls first")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="mean engine step in ms: skip measuring it on a server")
    parser.add_argument("--step-batch", type=int, default=16,
                        help="concurrent decoding streams while measuring the step time")
    parser.add_argument("--step-window", type=float, default=30.0,
                        help="seconds of the step-time measurement window")
    parser.add_argument("--step-max-tokens", type=int, default=200,
                        help="tokens per request of the step-time load (long: few prefills)")
    json_option(parser, "predictor_cost.json")
    args = parser.parse_args()
    exit_on_sigterm()
    info = header("predictor cost per engine step vs the mean engine step")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]

    predictors = load_both(Path(args.model), Path(args.bundle))
    for name, p in predictors.items():
        print(f"{name}: {type(p).__name__}, source {p.source}, {p.bundle_id}; {engine_path(p)}")
    # The step time only feeds the static term: any plausible value costs the same.
    costs = time_all(predictors, batches, args.repeats, args.warmup, step_s=0.01)
    step: dict[str, Any]
    failed = False
    if args.step_ms is not None:
        step = {"step_ms": args.step_ms, "given": True}
    else:  # after the timing: the server must not share the cores with it
        try:
            step = measure_step(args.model, args.step_batch, args.step_window,
                                args.step_max_tokens)
            print(f"mean engine step with the plugin at {args.step_batch} streams: "
                  f"{step['step_ms']:.2f} ms ({step['steps']:.0f} steps in "
                  f"{step['window_s']:.1f} s, {step['tokens_per_step']:.1f} tokens per step; "
                  f"streams' mean inter-chunk gap {step['client_itl_ms']:.2f} ms)")
        except ServerError as exc:  # keep the timings: they did not need the server
            print(f"step time NOT measured, the server failed: {exc}")
            step, failed = {"step_ms": float("nan"), "error": str(exc)[:2000]}, True
    print_table(costs, step["step_ms"])
    results = verdicts(costs)
    finish_run(info, args, {
        "predictors": {k: {"type": type(p).__name__, "source": p.source,
                           "bundle_id": p.bundle_id, "engine_path": engine_path(p)}
                       for k, p in predictors.items()},
        "step": step, "us_per_step": {str(n): row for n, row in costs.items()},
        "target_us": TARGET_US, "target_batch": TARGET_BATCH, "verdicts": results})
    return 1 if failed else 0  # a measurement, not a test: a MISS is a result, not a failure


if __name__ == "__main__":
    sys.exit(main())
