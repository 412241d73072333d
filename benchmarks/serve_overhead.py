"""Plugin on versus off, side by side in one run: serving throughput ratio and per-step cost.

A plain `vllm serve` and one with `--plugins piep`, of the same model, take turns (A B B A
A B ...: one at a time, since two servers would pin their workers to the same core), each
round starting its server, warming it up and sending the same workload; alternation makes
the drifts of this shared machine hit both alike. Reported: output-token throughput of each
round, the ratio with/without (target >= 0.99), and the plugin's own work per engine step
(engine core and API server separately) and the worker's step span (always on; and with a span
file) timed in-process at several batch sizes, against the measured mean step time.

    .venv/bin/python benchmarks/serve_overhead.py --model .cache/tiny-llama
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_piep.server import ServerOptions, VllmServer, exit_on_sigterm


@dataclass
class Round:
    server: str  # "plain" or "piep"
    seconds: float
    output_tokens: int
    steps: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def workload(n: int, seed: int, max_tokens: int, vocab: int = 2000) -> list[dict]:
    rng = random.Random(seed)
    return [{"model": "model",
             "prompt": [rng.randrange(2, vocab) for _ in range(rng.randint(8, 64))],
             "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0} for _ in range(n)]


async def drive(base_url: str, requests: list[dict], concurrency: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        async def one(body: dict) -> None:
            nonlocal tokens
            async with sem:
                r = await client.post("/v1/completions", json=body)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(one(b) for b in requests))
        return time.perf_counter() - start, tokens


def engine_steps(server: VllmServer) -> float:
    for line in server.get_text("/metrics").splitlines():
        if line.startswith("vllm:iteration_tokens_total_count"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def plugin_cost_per_step(batch_sizes: list[int], repeats: int = 2000
                         ) -> dict[int, dict[str, float]]:
    """Median µs of the plugin's own work for one decode step of `n` requests, split where it
    runs: in the engine core (on the step's critical path: reading the scheduled batch,
    prediction, split, running totals, records onto the outputs) and in the API server
    (taking the records off the outputs)."""
    from vllm_piep.accounting import EngineAccountant
    from vllm_piep.flops import ModelShape
    from vllm_piep.hooks.engine import _step_batch
    from vllm_piep.ledger import EnergyLedger
    from vllm_piep.predict.prior import PriorPredictor
    from vllm_piep.predict.profiles import DeviceProfile, cpu_spec

    shape = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2,
                       head_dim=32, vocab=2048, dtype_bytes=4)
    prior = PriorPredictor(shape, DeviceProfile.from_spec(cpu_spec(), 4))
    out: dict[int, dict[str, float]] = {}
    for n in batch_sizes:
        ids = [f"req-{i}" for i in range(n)]
        requests = {r: SimpleNamespace(num_computed_tokens=100, num_prompt_tokens=40,
                                       num_tokens=100) for r in ids}
        scheduler = SimpleNamespace(requests=requests)
        sched_out = SimpleNamespace(num_scheduled_tokens={r: 1 for r in ids},
                                    scheduled_spec_decode_tokens={})
        acc = EngineAccountant(lambda: prior)
        ledger = EnergyLedger()
        engine, api = [], []
        for k in range(repeats):
            t0 = time.perf_counter_ns()
            req_ids, batch = _step_batch(scheduler, sched_out)
            acc.on_schedule(k, req_ids, batch)
            acc.on_step_done(k)
            header_raw = acc.header().encode()
            params = [{"piep": row} for row in acc.encode_rows(req_ids)]
            t1 = time.perf_counter_ns()
            header = ledger.observe_header(header_raw)
            for r, p in zip(req_ids, params, strict=True):
                ledger.update(r, r, header, p.pop("piep"))
            t2 = time.perf_counter_ns()
            engine.append(t1 - t0)
            api.append(t2 - t1)
        out[n] = {"engine_us": statistics.median(engine) / 1e3,
                  "api_us": statistics.median(api) / 1e3}
    return out


def step_span_cost_per_step(batch_sizes: list[int], repeats: int = 3000
                            ) -> dict[int, dict[str, float]]:
    """Median µs that the worker-side step span adds to one step of `n` decoding requests, as
    the difference between vLLM's `execute_model` + `sample_tokens` called bare and through the
    plugin's wrappers, timed alternately in one loop: `always` is what every served step pays
    (the step timer); `file` adds the step recorder writing this rank's step spans
    (`spans_dir` set; counting the step's tokens and the JSON encoding run on the writer thread,
    off the step)."""
    import tempfile

    from vllm_piep.hooks import worker as worker_hooks
    from vllm_piep.hooks.detail import RECORDER_ATTR
    from vllm_piep.recorder import StepRecorder
    from vllm_piep.spans import SpanHeader, SpanWriter

    def execute_model(self: object, scheduler_output: object) -> None:
        return None

    def sample_tokens(self: object, grammar: object) -> object:
        return SimpleNamespace(req_ids=())

    wrapped_exec = worker_hooks._wrap_execute_model(execute_model)
    wrapped_sample = worker_hooks._wrap_sample_tokens(sample_tokens)
    out: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in batch_sizes:
            ids = [f"req-{i}" for i in range(n)]
            runner = SimpleNamespace(requests={r: SimpleNamespace(num_prompt_tokens=40)
                                               for r in ids})
            sched = SimpleNamespace(
                num_scheduled_tokens={r: 1 for r in ids}, scheduled_new_reqs=[],
                scheduled_cached_reqs=SimpleNamespace(req_ids=ids,
                                                      num_computed_tokens=[100] * n),
                finished_req_ids=set())
            plain = SimpleNamespace(model_runner=runner)
            writer = SpanWriter(Path(tmp) / f"b{n}.spans.jsonl",
                                SpanHeader(rank=0, world_size=1, host="bench", pid=0))
            recording = SimpleNamespace(model_runner=runner)
            recording.__dict__[RECORDER_ATTR] = StepRecorder(writer,
                                                             counter=worker_hooks.StepCounter())
            bare, timed, filed = [], [], []
            for _ in range(repeats):
                t0 = time.perf_counter_ns()
                execute_model(plain, sched)
                sample_tokens(plain, None)
                t1 = time.perf_counter_ns()
                wrapped_exec(plain, sched)
                wrapped_sample(plain, None)
                t2 = time.perf_counter_ns()
                wrapped_exec(recording, sched)
                wrapped_sample(recording, None)
                t3 = time.perf_counter_ns()
                bare.append(t1 - t0)
                timed.append(t2 - t1)
                filed.append(t3 - t2)
            writer.close()
            base = statistics.median(bare)
            out[n] = {"always_us": (statistics.median(timed) - base) / 1e3,
                      "file_us": (statistics.median(filed) - base) / 1e3}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="output tokens per request (long enough that the engine, not the "
                             "HTTP front end, bounds throughput)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds per server")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" /
                        "serve_overhead.json")
    args = parser.parse_args()
    exit_on_sigterm()

    logs = args.json.parent
    options = {"plain": ServerOptions(model=args.model, plugin="off"),
               "piep": ServerOptions(model=args.model, plugin="flag")}
    order = [name for i in range(args.rounds)
             for name in (("plain", "piep") if i % 2 == 0 else ("piep", "plain"))]
    rounds: list[Round] = []
    for i, name in enumerate(tqdm(order, desc="rounds A B B A", unit="round")):
        reqs = workload(args.requests, seed=i // 2, max_tokens=args.max_tokens)  # same per pair
        with VllmServer(options[name], log_path=logs / f"{name}.log") as server:
            asyncio.run(drive(server.base_url, reqs[: args.concurrency], args.concurrency))
            steps0 = engine_steps(server)
            seconds, tokens = asyncio.run(drive(server.base_url, reqs, args.concurrency))
            rounds.append(Round(name, seconds, tokens, engine_steps(server) - steps0))

    def tput(name: str) -> list[float]:
        return [r.tokens_per_s for r in rounds if r.server == name]

    pair_ratios = [b / a for a, b in zip(tput("plain"), tput("piep"), strict=True)]
    ratio = sum(tput("piep")) / sum(tput("plain"))
    median_ratio = statistics.median(pair_ratios)
    piep_rounds = [r for r in rounds if r.server == "piep"]
    step_ms = 1e3 * sum(r.seconds for r in piep_rounds) / sum(r.steps for r in piep_rounds)
    cost = plugin_cost_per_step([1, 16, 32, 64, 256])
    spans_cost = step_span_cost_per_step([1, 16, 64, 256])

    print(f"\nworkload: {args.requests} requests x {args.max_tokens} output tokens, "
          f"{args.concurrency} concurrent, {args.rounds} rounds per server, alternated")
    for r in rounds:
        print(f"  {r.server:<5} {r.tokens_per_s:8.1f} output tok/s  ({r.seconds:.1f} s, "
              f"{r.steps:.0f} steps)")
    print(f"throughput ratio piep/plain: {ratio:.4f} over all rounds, median of pairs "
          f"{median_ratio:.4f} (pairs: {', '.join(f'{x:.3f}' for x in pair_ratios)}; "
          f"target >= 0.99)")
    print(f"mean engine step with the plugin: {step_ms:.2f} ms")
    for n, us in cost.items():
        print(f"  plugin work per step at batch {n:>3}: engine core {us['engine_us']:7.1f} us "
              f"({100 * us['engine_us'] / 1e3 / step_ms:.2f} % of a mean step), API server "
              f"{us['api_us']:6.1f} us (medians)")
    for n, us in spans_cost.items():
        print(f"  step span per step at batch {n:>3} (worker): always on {us['always_us']:5.2f} us"
              f" ({100 * us['always_us'] / 1e3 / step_ms:.3f} % of a mean step), with a span "
              f"file {us['file_us']:6.2f} us (medians)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "rounds": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rounds],
        "throughput_ratio": ratio, "median_pair_ratio": median_ratio,
        "pair_ratios": pair_ratios, "mean_step_ms": step_ms,
        "plugin_us_per_step": cost, "step_span_us_per_step": spans_cost,
        "args": {k: str(v) for k, v in vars(args).items()},
    }, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
