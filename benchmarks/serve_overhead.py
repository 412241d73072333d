"""Plugin on versus off, side by side in one run: streaming throughput and inter-token latency.

A plain `vllm serve` and one with `--plugins piep`, of the same model, both up for the whole
run, take turns: in each round every concurrency (32 then 128 streams) is driven on one server
and then on the other, A B in even rounds and B A in odd ones, on the same seeded workload:
random token-id prompts, a fixed `max_tokens` with `ignore_eos`, streamed with
`stream_options.include_usage` over httpx. Only one server is driven at a time (two would share
the machine's two cores); the idle one's CPU during each run is recorded, the bias it could
add. Short alternated runs make the drifts of this shared machine hit both servers alike, and
many of them cost no start-up each. `--restart` starts each server afresh every round instead
(one server up at a time).

Per run: output tokens/s (tokens from each stream's final usage chunk, over the run's wall time),
mean inter-token latency (per stream, the mean gap between consecutive content chunks; then the
mean over streams), engine steps (from /metrics), CPU seconds of each of the server's processes
(API server, engine core, worker) per output token, and on piep rounds how many streams lacked
`usage.energy` (on plain rounds, how many had it: both must be 0), and content chunks per token
(a stream that lags gets several tokens in one chunk; the API server's CPU follows chunks more
than tokens). Per concurrency: each process's CPU per token piep/plain (API server and engine
core, median of the pairs with a 95 % CI, target <= 1.03), chunks and engine steps per token
of each server, the API server's CPU per chunk piep/plain; throughput
ratio piep/plain over all rounds (ratio of the mean throughputs; the PASS/MISS verdict, target
>= 0.99), the median of the pair ratios, the ITL ratio, and the plain rounds' own spread (the
noise a ratio must be read against). Also timed in-process: the worker-side step span the plugin
adds to every step (kept: it takes about a second).

    .venv/bin/python benchmarks/serve_overhead.py --model .cache/tiny-llama --rounds 10 \
        --requests 256 --max-tokens 128 --concurrency 32,128 --json

The helpers above `main` (header, workload, streaming driver, /metrics parsing) are imported by
`predictor_cost.py` and `memory.py` beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TENANT_HEADER = "x-tenant-id"
sys.path.insert(0, str(ROOT))

from vllm_piep.tools.server import (  # noqa: E402
    ServerError,
    ServerOptions,
    VllmServer,
    exit_on_sigterm,
)

THROUGHPUT_TARGET = 0.99
CPU_TARGET = 1.03  # each process's CPU per output token, piep/plain
CPU_TARGET_ROLES = ("api-server", "EngineCore")


# --------------------------------------------------------------------------- shared helpers
def header(title: str) -> dict[str, Any]:
    """Print what a reader needs to trust the figures (command, date, cores, load), and return
    it for the JSON."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    info = {
        "title": title,
        "command": shlex.join([os.path.relpath(sys.executable, Path.cwd()), *sys.argv]),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": len(os.sched_getaffinity(0)),
        "loadavg_start": os.getloadavg()[0],  # others' jobs on this shared machine skew figures
        "git_commit": commit,
    }
    print(f"# {title}\n# command: {info['command']}\n# date: {info['date']}   nproc: "
          f"{info['nproc']}   load average (1 min): {info['loadavg_start']:.2f}   commit: "
          f"{commit or '?'}", flush=True)
    if info["loadavg_start"] > 0.5:  # the client and the servers share these cores
        print(f"# WARNING: the machine is not idle (load {info['loadavg_start']:.2f}): other "
              "jobs take CPU from the server and this client; expect noisy figures", flush=True)
    return info


@contextmanager
def serving(options: ServerOptions, log_path: Path, attempts: int = 4,
            backoff_s: float = 20.0) -> Iterator[VllmServer]:
    """A started server, stopped on leaving. A failed start is retried after a pause (its log
    kept beside, `*.failedN.log`): on this shared machine another job's `VllmServer.stop()`
    can unlink a named semaphore ours is starting with (its scan of /proc/*/maps never sees
    named semaphores as held), and one such race must not lose a long run."""
    for attempt in range(1, attempts + 1):
        server = VllmServer(options, log_path=log_path)
        try:
            server.start()  # stops what it started if it fails
        except ServerError as exc:
            kept = log_path.with_suffix(f".failed{attempt}.log")
            if log_path.exists():
                log_path.replace(kept)
            if attempt == attempts:
                raise
            tqdm.write(f"server start failed (attempt {attempt}/{attempts}; log {kept}): "
                       f"{str(exc).splitlines()[-1][:200]}; retrying")
            time.sleep(backoff_s)
            continue
        try:
            yield server
        finally:
            server.stop()
        return


def role_of(proc: psutil.Process, root_pid: int) -> str:
    """A name that is the same for the same process in every server: vLLM titles its engine
    core and workers `VLLM::...` (setproctitle)."""
    if proc.pid == root_pid:
        return "api-server"
    name = proc.name()
    if name.startswith("VLLM::"):
        return name.removeprefix("VLLM::")
    cmdline = " ".join(proc.cmdline())
    if "resource_tracker" in cmdline:
        return "resource-tracker"
    return name or cmdline[:40]


def cpu_seconds(server: VllmServer) -> dict[str, float]:
    """CPU seconds (user + system) each role of the server's process tree has used so far."""
    assert server.pid is not None
    root = psutil.Process(server.pid)
    out: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            role = role_of(proc, server.pid)
        except (psutil.NoSuchProcess, OSError):
            continue
        out[role] = out.get(role, 0.0) + times.user + times.system
    return out


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def workload(n: int, seed: int, max_tokens: int, prompt_tokens: tuple[int, int] = (8, 64),
             vocab: int = 2000) -> list[dict[str, Any]]:
    """`n` streamed completion bodies with seeded random token-id prompts: the same seed gives
    both members of a pair the same work (token ids, not text: no tokenizer in the way)."""
    rng = random.Random(seed)
    return [{"model": "model",
             "prompt": [rng.randrange(2, vocab) for _ in range(rng.randint(*prompt_tokens))],
             "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}} for _ in range(n)]


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    output_tokens: int = 0  # from the final usage chunk
    chunks: int = 0  # content chunks
    mean_gap_s: float | None = None  # mean gap between consecutive content chunks
    last_s: float | None = None  # from sending the request to its last content chunk
    energy_source: str | None = None  # usage.energy.source, None without usage.energy


def http_client(base_url: str, concurrency: int) -> httpx.AsyncClient:
    # httpx pools at most 100 connections by default: 128 streams would queue in the client.
    # No keep-alive: a pooled connection the server times out just as a request goes out on
    # it ends that request with a ReadError (seen here); a fresh connection costs ~0.1 ms.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    # Every request names a tenant (read only by a server that keeps a billing ledger).
    return httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits,
                             headers={TENANT_HEADER: "bench-tenant"})


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any]) -> Stream:
    """Send one streaming completion; time its content chunks, read its final usage."""
    out = Stream()
    first = last = 0.0
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue  # blank separators and `data: [DONE]`
            if '"usage"' in line:  # only the final chunk: parse just that one (client CPU)
                usage = json.loads(line[6:])["usage"] or {}
                out.output_tokens = int(usage.get("completion_tokens") or 0)
                energy = usage.get("energy")
                out.energy_source = str(energy.get("source")) if energy else None
                continue
            now = time.perf_counter()
            if out.chunks == 0:
                first = now
            last = now
            out.chunks += 1
    if out.chunks >= 2:
        out.mean_gap_s = (last - first) / (out.chunks - 1)
    if out.chunks:
        out.last_s = last - sent
    return out


async def run_load(base_url: str, bodies: list[dict[str, Any]], concurrency: int
                   ) -> tuple[float, list[Stream]]:
    """All `bodies` with at most `concurrency` streams open; wall seconds and each stream."""
    sem = asyncio.Semaphore(concurrency)
    async with http_client(base_url, concurrency) as client:
        async def one(body: dict[str, Any]) -> Stream:
            async with sem:
                return await stream_one(client, body)

        start = time.perf_counter()
        streams = await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - start, list(streams)


def metric_total(text: str, name: str) -> float:
    """Sum of a Prometheus sample over its label sets (`name{...} value` or `name value`)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else float("nan")


def engine_steps(server: VllmServer) -> float:
    """Engine steps so far: every step observes one sample of this histogram."""
    return metric_total(server.get_text("/metrics"), "vllm:iteration_tokens_total_count")


# --------------------------------------------------------------------------- this benchmark
@dataclass
class Run:
    round: int
    server: str  # "plain" or "piep"
    concurrency: int
    seconds: float
    output_tokens: int
    steps: float
    itl_ms: float  # mean over streams of each stream's mean inter-chunk gap
    ttlt_ms: float  # median over streams of the time to the last token
    streams: int
    with_energy: int  # streams whose final usage carried usage.energy
    sources: list[str] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # the server's CPU by process role
    idle_cpu_s: float = float("nan")  # the other server's, idle beside it (resident mode)
    # Content chunks over all streams: a stream that lags behind the engine gets several
    # tokens merged into one chunk (vLLM's RequestOutputCollector), and the API server's CPU
    # follows chunks more than tokens.
    chunks: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def cpu_ms_per_token(self) -> float:
        return 1e3 * sum(self.cpu_s.values()) / self.output_tokens


def measure(server: VllmServer, name: str, round_no: int, concurrency: int,
            bodies: list[dict[str, Any]], idle: VllmServer | None = None) -> Run:
    steps0 = engine_steps(server)
    cpu0 = cpu_seconds(server)
    idle0 = sum(cpu_seconds(idle).values()) if idle is not None else float("nan")
    seconds, streams = asyncio.run(run_load(server.base_url, bodies, concurrency))
    cpu1 = cpu_seconds(server)
    idle_s = sum(cpu_seconds(idle).values()) - idle0 if idle is not None else float("nan")
    gaps = [s.mean_gap_s for s in streams if s.mean_gap_s is not None]
    lasts = [s.last_s for s in streams if s.last_s is not None]
    return Run(round_no, name, concurrency, seconds, sum(s.output_tokens for s in streams),
               engine_steps(server) - steps0,
               1e3 * statistics.fmean(gaps) if gaps else float("nan"),
               1e3 * statistics.median(lasts) if lasts else float("nan"), len(streams),
               sum(s.energy_source is not None for s in streams),
               sorted({s.energy_source for s in streams if s.energy_source}),
               {role: cpu1[role] - cpu0.get(role, 0.0) for role in cpu1}, idle_s,
               sum(s.chunks for s in streams))


def summarize(runs: list[Run], concurrency: int) -> dict[str, Any]:
    """Ratios piep/plain at one concurrency, pairs matched by round."""
    plain = {r.round: r for r in runs if r.server == "plain" and r.concurrency == concurrency}
    piep = {r.round: r for r in runs if r.server == "piep" and r.concurrency == concurrency}
    pairs = [(plain[k], piep[k]) for k in sorted(plain) if k in piep]
    tput_plain = [a.tokens_per_s for a, _ in pairs]
    tput_piep = [b.tokens_per_s for _, b in pairs]
    pair_tput = [b / a for a, b in zip(tput_plain, tput_piep, strict=True)]
    pair_itl = [b.itl_ms / a.itl_ms for a, b in pairs]
    pair_ttlt = [b.ttlt_ms / a.ttlt_ms for a, b in pairs]
    ratio = statistics.fmean(tput_piep) / statistics.fmean(tput_plain)
    median = statistics.median(pair_tput)
    low, high = ratio_ci95(pair_tput)
    # CPU per output token: the work each server did for the same tokens, which the machine's
    # drifts move far less than its throughput.
    pair_cpu = [b.cpu_ms_per_token / a.cpu_ms_per_token for a, b in pairs]
    roles = sorted({r for a, b in pairs for r in (*a.cpu_s, *b.cpu_s)})

    def role_ms(runs_: list[Run], role: str) -> float:
        return statistics.median(1e3 * r.cpu_s.get(role, 0.0) / r.output_tokens for r in runs_)

    def per_token(run: Run, role: str) -> float:
        return run.cpu_s.get(role, 0.0) / run.output_tokens

    def per_chunk(run: Run, role: str) -> float:
        return run.cpu_s.get(role, 0.0) / max(run.chunks, 1)

    # The targets are per process: each one's CPU per token, piep/plain, median of the pairs.
    by_role = {}
    for role in CPU_TARGET_ROLES:
        ratios = [per_token(b, role) / per_token(a, role) for a, b in pairs
                  if per_token(a, role) > 0]
        if not ratios:
            continue
        median_role = statistics.median(ratios)
        by_role[role] = {"median_pair_ratio": median_role, "ci95": list(ratio_ci95(ratios)),
                         "pair_ratios": ratios,
                         "verdict": verdict(median_role <= CPU_TARGET)}
    api = CPU_TARGET_ROLES[0]
    chunk_ratios = [per_chunk(b, api) / per_chunk(a, api) for a, b in pairs
                    if per_chunk(a, api) > 0]
    return {
        "concurrency": concurrency,
        "pairs": len(pairs),
        "plain_tokens_per_s": tput_plain,
        "piep_tokens_per_s": tput_piep,
        "throughput_ratio": ratio,
        "median_pair_throughput_ratio": median,
        "pair_throughput_ratios": pair_tput,
        # The pair ratios' geometric mean and its 95 % t-interval (log scale).
        "throughput_ratio_ci95": [low, high],
        "median_pair_ttlt_ratio": statistics.median(pair_ttlt),
        "plain_ttlt_ms": [a.ttlt_ms for a, _ in pairs],
        "piep_ttlt_ms": [b.ttlt_ms for _, b in pairs],
        "itl_ratio": (statistics.fmean(b.itl_ms for _, b in pairs)
                      / statistics.fmean(a.itl_ms for a, _ in pairs)),
        "median_pair_itl_ratio": statistics.median(pair_itl),
        # Plain against plain: how far rounds of the same server drift apart on this machine.
        "plain_spread": (max(tput_plain) - min(tput_plain)) / statistics.fmean(tput_plain),
        "median_pair_cpu_per_token_ratio": statistics.median(pair_cpu),
        "cpu_per_token_ratio_by_role": by_role,
        # The same at equal chunks and steps per token (a fit over this concurrency's runs):
        # what is left of the ratio once the engine's cadence, which the plugin's own CPU on
        # these shared cores moves, is held equal.
        "cpu_per_token_ratio_adjusted": {
            role: adjusted_effect([r for r in runs if r.concurrency == concurrency], role)
            for role in CPU_TARGET_ROLES},
        "cpu_target": CPU_TARGET,
        # What moves the API server's CPU besides the plugin: chunks per token (streams that
        # keep up get a chunk per token) and the engine's steps per token.
        "chunks_per_token": [statistics.median(a.chunks / a.output_tokens for a, _ in pairs),
                             statistics.median(b.chunks / b.output_tokens for _, b in pairs)],
        "steps_per_token": [statistics.median(a.steps / a.output_tokens for a, _ in pairs),
                            statistics.median(b.steps / b.output_tokens for _, b in pairs)],
        "api_cpu_per_chunk_ratio": ({"median_pair_ratio": statistics.median(chunk_ratios),
                                     "ci95": list(ratio_ci95(chunk_ratios))}
                                    if chunk_ratios else None),
        "cpu_per_token_ratio_ci95": list(ratio_ci95(pair_cpu)),
        # Median CPU ms per output token, by process role (plain, piep).
        "cpu_ms_per_token_by_role": {r: [role_ms([a for a, _ in pairs], r),
                                         role_ms([b for _, b in pairs], r)] for r in roles},
        "idle_neighbour_cpu_s": [[a.idle_cpu_s for a, _ in pairs],
                                 [b.idle_cpu_s for _, b in pairs]],
        "piep_streams_without_energy": sum(b.streams - b.with_energy for _, b in pairs),
        "plain_streams_with_energy": sum(a.with_energy for a, _ in pairs),
        "target": THROUGHPUT_TARGET,
        # Indistinguishable: the median pair ratio at least the target, and the interval
        # reaching above 1.
        "verdict": verdict(median >= THROUGHPUT_TARGET and high > 1.0),
    }


# What moves each process's CPU per token on this machine besides the plugin: the API server's
# follows chunks per token and engine steps per token, the engine core's steps per token.
COVARIATES = {"api-server": ("chunks", "steps"), "EngineCore": ("steps",)}


def adjusted_effect(runs: list[Run], role: str) -> dict[str, Any] | None:
    """The plugin's effect on one process's CPU per token at equal chunks and steps per token:
    least squares of every run's CPU per token on its covariates (`COVARIATES`) and a plugin
    indicator; the indicator's coefficient as a ratio to plain's mean, with its 95 % t-interval.
    None with too few runs to fit."""
    import numpy as np
    from scipy import stats

    covariates = COVARIATES[role]
    y = np.array([r.cpu_s.get(role, 0.0) / r.output_tokens for r in runs])
    columns = [np.ones(len(runs))]
    columns += [np.array([getattr(r, name) / r.output_tokens for r in runs])
                for name in covariates]
    plugin = np.array([r.server == "piep" for r in runs], dtype=float)
    x = np.column_stack([*columns, plugin])
    dof = len(runs) - x.shape[1]
    if dof < 2 or not plugin.any() or plugin.all():
        return None
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ beta
    se = math.sqrt(float(resid @ resid) / dof * np.linalg.pinv(x.T @ x)[-1, -1])
    half = float(stats.t.ppf(0.975, dof)) * se
    plain_mean = float(y[plugin == 0].mean())
    total = float(((y - y.mean()) @ (y - y.mean())))
    return {"covariates": list(covariates), "ratio": 1 + beta[-1] / plain_mean,
            "ci95": [1 + (beta[-1] - half) / plain_mean, 1 + (beta[-1] + half) / plain_mean],
            "r2": 1 - float(resid @ resid) / total if total > 0 else float("nan")}


def ratio_ci95(ratios: list[float]) -> tuple[float, float]:
    """95 % t-interval of the pair ratios' geometric mean (NaN with fewer than two pairs)."""
    if len(ratios) < 2:
        return float("nan"), float("nan")
    from scipy import stats

    logs = [math.log(r) for r in ratios]
    half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def step_span_cost_per_step(batch_sizes: list[int], repeats: int = 3000
                            ) -> dict[int, dict[str, float]]:
    """Median µs that the worker-side step span adds to one step of `n` decoding requests, as
    the difference between vLLM's `execute_model` + `sample_tokens` called bare and through the
    plugin's wrappers, timed alternately in one loop: `always` is what every served step pays
    (the step timer); `file` adds the step recorder writing this rank's step spans
    (`spans_dir` set; counting the step's tokens and the JSON encoding run on the writer thread,
    off the step)."""
    import tempfile

    from vllm_piep.runtime.worker import step as worker_hooks
    from vllm_piep.runtime.worker.batch import StepCounter
    from vllm_piep.runtime.worker.recorder import StepRecorder
    from vllm_piep.runtime.worker.step import RECORDER_ATTR
    from vllm_piep.spans.records import SpanHeader
    from vllm_piep.spans.writer import SpanWriter

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
                                                             counter=StepCounter())
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


def span_cost_or_none() -> dict[int, dict[str, float]] | None:
    # It reaches into the worker hooks' internals, which may be refactored: the served A/B
    # figures must not be lost to a renamed helper.
    try:
        return step_span_cost_per_step([1, 16, 64, 256])
    except Exception as exc:
        print(f"step span cost: skipped ({type(exc).__name__}: {exc})")
        return None


def print_runs(runs: list[Run]) -> None:
    print("\nper run (round, server, streams):")
    for r in runs:
        energy = (f"{r.streams - r.with_energy} without usage.energy" if r.server == "piep"
                  else f"{r.with_energy} with usage.energy")
        print(f"  round {r.round} {r.server:<5} c={r.concurrency:<4} {r.tokens_per_s:8.1f} "
              f"tok/s  ITL {r.itl_ms:7.2f} ms  TTLT {r.ttlt_ms:8.1f} ms  "
              f"({r.output_tokens} tokens in {r.seconds:6.1f} s,"
              f" {r.steps:.0f} steps, {r.chunks / r.output_tokens:.2f} chunks/token;"
              f" {r.streams} streams, {energy}"
              f"{'; source ' + ','.join(r.sources) if r.sources else ''}; CPU "
              f"{r.cpu_ms_per_token:.3f} ms/token"
              f"{'' if math.isnan(r.idle_cpu_s) else f', idle neighbour {r.idle_cpu_s:.2f} s'})")


def print_summary(s: dict[str, Any]) -> None:
    pairs = ", ".join(f"{x:.3f}" for x in s["pair_throughput_ratios"])
    roles = ", ".join(f"{r} {a:.3f} -> {b:.3f}" for r, (a, b) in
                      s["cpu_ms_per_token_by_role"].items())
    print(f"\nconcurrency {s['concurrency']} ({s['pairs']} pairs):\n"
          f"  throughput piep/plain: median of pairs {s['median_pair_throughput_ratio']:.4f}, "
          f"geometric mean 95 % CI {s['throughput_ratio_ci95'][0]:.4f}-"
          f"{s['throughput_ratio_ci95'][1]:.4f}, {s['throughput_ratio']:.4f} over all rounds "
          f"(pairs: {pairs})\n"
          f"  target: median >= {s['target']} and the interval above 1: {s['verdict']}\n"
          f"  time to last token piep/plain (median of pairs of per-run medians): "
          f"{s['median_pair_ttlt_ratio']:.4f}\n"
          f"  ITL piep/plain: {s['itl_ratio']:.4f} over all rounds, median of pairs "
          f"{s['median_pair_itl_ratio']:.4f} (above 1: the plugin is slower)\n"
          f"  plain rounds' own spread (max - min) / mean: {100 * s['plain_spread']:.1f} %\n"
          f"  CPU per output token piep/plain: median of pairs "
          f"{s['median_pair_cpu_per_token_ratio']:.4f}, 95 % CI "
          f"{s['cpu_per_token_ratio_ci95'][0]:.4f}-{s['cpu_per_token_ratio_ci95'][1]:.4f}; "
          f"ms/token by process (plain -> piep): {roles}\n"
          + "".join(f"  {role} CPU per token piep/plain: median of pairs "
                    f"{v['median_pair_ratio']:.4f}, 95 % CI {v['ci95'][0]:.4f}-"
                    f"{v['ci95'][1]:.4f}; target <= {s['cpu_target']}: {v['verdict']}\n"
                    for role, v in s["cpu_per_token_ratio_by_role"].items())
          + "".join(f"  {role} CPU per token piep/plain at equal "
                    f"{' and '.join(v['covariates'])} per token (fit over the runs, R² "
                    f"{v['r2']:.2f}): {v['ratio']:.4f}, 95 % CI {v['ci95'][0]:.4f}-"
                    f"{v['ci95'][1]:.4f}\n"
                    for role, v in s["cpu_per_token_ratio_adjusted"].items() if v)
          + f"  chunks per token (plain, piep): {s['chunks_per_token'][0]:.3f}, "
          f"{s['chunks_per_token'][1]:.3f}; engine steps per token: "
          f"{s['steps_per_token'][0]:.4f}, {s['steps_per_token'][1]:.4f}"
          + (f"; api-server CPU per chunk piep/plain: median of pairs "
             f"{s['api_cpu_per_chunk_ratio']['median_pair_ratio']:.4f}, 95 % CI "
             f"{s['api_cpu_per_chunk_ratio']['ci95'][0]:.4f}-"
             f"{s['api_cpu_per_chunk_ratio']['ci95'][1]:.4f}"
             if s["api_cpu_per_chunk_ratio"] else "") + "\n"
          f"  streams without usage.energy on piep rounds: {s['piep_streams_without_energy']};"
          f" with it on plain rounds: {s['plain_streams_with_energy']}")


def json_option(parser: argparse.ArgumentParser, name: str) -> None:
    """`--json [PATH]`: where `finish_run` writes the results (`benchmarks/results/NAME` when
    the path is left out)."""
    parser.add_argument("--json", nargs="?", type=Path, const=RESULTS / name, default=None,
                        help=f"write the results there (default path: benchmarks/results/{name})")


def finish_run(info: dict[str, Any], args: argparse.Namespace, results: dict[str, Any]
               ) -> None:
    """The end of every benchmark: the load at the end, and the results as JSON (`--json`)
    with the header and the arguments."""
    info["loadavg_end"] = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {info['loadavg_end']:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "header": info, "args": {k: str(v) for k, v in vars(args).items()}, **results,
        }, indent=2))
        print(f"wrote {args.json}")


def bodies_of(args: argparse.Namespace, round_no: int, concurrency: int
              ) -> list[dict[str, Any]]:
    """A round's workload at one concurrency: the same seed for plain and piep (the same
    prompts)."""
    return workload(args.requests, seed=1000 * round_no + concurrency, max_tokens=args.max_tokens)


def restarted(options: dict[str, ServerOptions], args: argparse.Namespace, levels: list[int],
              warmup: list[dict[str, Any]], bar: tqdm) -> list[Run]:
    """`--restart`: each round starts each server afresh (plain, then piep)."""
    runs: list[Run] = []
    for round_no in range(args.rounds):
        for name in ("plain", "piep"):
            bar.set_postfix_str(f"round {round_no} {name}: starting")
            with serving(options[name], RESULTS / f"{name}.log") as server:
                asyncio.run(run_load(server.base_url, warmup, max(levels)))
                for c in levels:
                    bar.set_postfix_str(f"round {round_no} {name} c={c}")
                    runs.append(measure(server, name, round_no, c, bodies_of(args, round_no, c)))
                    bar.update()
    return runs


def resident(options: dict[str, ServerOptions], args: argparse.Namespace, levels: list[int],
             warmup: list[dict[str, Any]], bar: tqdm) -> list[Run]:
    """Both servers up for the whole run (started one after the other), driven one at a time:
    many short alternated runs, A B then B A (so a drift within a round hits both alike),
    without a minute of start-up per run. The idle one's CPU during each run is recorded."""
    runs: list[Run] = []
    bar.set_postfix_str("starting both servers")
    with serving(options["plain"], RESULTS / "plain.log") as plain, \
            serving(options["piep"], RESULTS / "piep.log") as piep:
        servers = {"plain": plain, "piep": piep}
        for server in servers.values():
            asyncio.run(run_load(server.base_url, warmup, max(levels)))
        for round_no in range(args.rounds):
            order = ("plain", "piep") if round_no % 2 == 0 else ("piep", "plain")
            for c in levels:
                for name in order:
                    bar.set_postfix_str(f"round {round_no} {name} c={c}")
                    other = servers["piep" if name == "plain" else "plain"]
                    runs.append(measure(servers[name], name, round_no, c,
                                        bodies_of(args, round_no, c), idle=other))
                    bar.update()
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--rounds", type=int, default=3,
                        help="pairs plain, piep (default 3; a round drives both at every "
                             "concurrency)")
    parser.add_argument("--restart", action="store_true",
                        help="start both servers afresh every round (default: both stay up "
                             "and take turns)")
    parser.add_argument("--requests", type=int, default=512,
                        help="streamed requests per run (each concurrency of each round)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="output tokens per request (ignore_eos: always this many)")
    parser.add_argument("--concurrency", default="32,128",
                        help="comma-separated numbers of concurrent streams (vLLM's CPU "
                             "default max_num_seqs is 128: more would queue in the server)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="serve both with --async-scheduling (the server log says whether "
                             "the platform keeps it)")
    parser.add_argument("--ledger", action="store_true",
                        help="the plugin's server keeps a billing ledger (`ledger`, a file in "
                             "a temporary directory) with a tenant header on every request")
    parser.add_argument("--baseline", choices=("plain", "piep"), default="plain",
                        help="what the plugin's server is compared with: vLLM without the "
                             "plugin, or the plugin without a ledger (with --ledger: the "
                             "ledger's own cost); the output calls it `plain` either way")
    json_option(parser, "serve_overhead.json")
    args = parser.parse_args()
    exit_on_sigterm()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    info = header("serve overhead: plain vs --plugins piep, streamed, alternated")
    print(f"workload: {args.requests} streamed requests x {args.max_tokens} output tokens "
          f"(ignore_eos) per run, concurrency {levels}, {args.rounds} round(s) of "
          f"{'plain then piep, each started afresh' if args.restart else 'A B then B A, both up'}"
          f", model {args.model}", flush=True)

    spans = span_cost_or_none()  # in-process, before any server: nothing else on the cores
    extra = ("--async-scheduling",) if args.async_scheduling else ()
    ledger_env = {}
    if args.ledger:
        ledger_dir = Path(tempfile.mkdtemp(prefix="piep-ledger-"))
        ledger_env = {"PIEP_LEDGER": str(ledger_dir / "energy.db"),
                      "PIEP_TENANT_HEADER": TENANT_HEADER}
        print(f"the plugin's server keeps a billing ledger in {ledger_dir}")
    options = {"plain": ServerOptions(model=args.model, plugin=("off" if args.baseline == "plain"
                                                                else "flag"), extra_args=extra),
               "piep": ServerOptions(model=args.model, plugin="flag", extra_args=extra,
                                     extra_env=ledger_env)}
    if args.baseline == "piep":
        print("baseline (`plain` below): the plugin without a ledger")
    warmup = workload(max(levels), seed=10_000, max_tokens=16)
    bar = tqdm(total=args.rounds * 2 * len(levels), desc="runs", unit="run")
    play = restarted if args.restart else resident
    runs = play(options, args, levels, warmup, bar)
    bar.close()

    print_runs(runs)
    summaries = [summarize(runs, c) for c in levels]
    for s in summaries:
        print_summary(s)
    piep_runs = [r for r in runs if r.server == "piep" and r.concurrency == levels[0]]
    step_ms = 1e3 * sum(r.seconds for r in piep_runs) / sum(r.steps for r in piep_runs)
    print(f"\nmean engine step with the plugin at c={levels[0]}: {step_ms:.2f} ms "
          "(run wall time / engine steps)")
    for n, us in (spans or {}).items():
        print(f"  step span per step at batch {n:>3} (worker): always on {us['always_us']:5.2f} us"
              f" ({100 * us['always_us'] / 1e3 / step_ms:.3f} % of a mean step), with a span "
              f"file {us['file_us']:6.2f} us (medians)")
    finish_run(info, args, {
        "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in runs],
        "summary": summaries, "mean_step_ms_piep": step_ms, "step_span_us_per_step": spans})
    return 0  # a measurement, not a test: a MISS is a result


if __name__ == "__main__":
    sys.exit(main())
