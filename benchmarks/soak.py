"""Soak: mixed traffic against a server with two API server processes for a while (default 10
minutes), then the server's books once idle.

The traffic: completions and chat, streamed and not, `n > 1` and several prompts, clients that
cancel within 50 ms or disconnect mid-stream, and requests sharing one X-Request-Id. Reported:
failed requests (any HTTP error or a response without `usage.energy` where it should have one;
target 0), the conservation error once idle (Σ outcomes against the engine's step joules;
target 1e-9 relative), the tracked-state gauges once idle (target 0 besides `api_recent`'s
tombstones, which expire in 10 s), and each process's resident memory every minute of the
traffic (growth per process). `--plugin off` runs the same traffic against vLLM alone, for the
memory growth vLLM has by itself (its CPU KV cache pages are touched as more blocks get used).

    python benchmarks/soak.py --minutes 10 --json
    python benchmarks/soak.py --minutes 10 --plugin off --json benchmarks/results/soak-off.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families
from serve_overhead import RESULTS, ROOT, finish_run, header, json_option, serving

from vllm_piep.tools.server import ServerOptions, VllmServer, exit_on_sigterm

CHAT = [{"role": "user", "content": "def energy():"}]


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and label in sample.labels:
                key = sample.labels[label]
                out[key] = out.get(key, 0.0) + sample.value
    return out


def total(text: str, name: str) -> float:
    return math.fsum(s.value for f in text_string_to_metric_families(text)
                     for s in f.samples if s.name == name)


def body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(path, body) of a request whose response shows usage.energy."""
    tokens = rng.randint(1, 48)
    kind = rng.random()
    if kind < 0.35:
        return "/v1/completions", {"model": "model", "prompt": "import os", "max_tokens": tokens,
                                   "ignore_eos": True}
    if kind < 0.55:
        return "/v1/completions", {"model": "model", "prompt": ["a", "b c"], "n": 2,
                                   "max_tokens": tokens, "ignore_eos": True}
    if kind < 0.75:
        return "/v1/chat/completions", {"model": "model", "messages": CHAT, "stream": True,
                                        "stream_options": {"include_usage": True},
                                        "max_tokens": tokens, "ignore_eos": True}
    return "/v1/chat/completions", {"model": "model", "messages": CHAT, "max_tokens": tokens,
                                    "ignore_eos": True}


def send(server: VllmServer, path: str, payload: dict[str, Any], request_id: str | None
         ) -> str:
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(server.base_url + path, data=json.dumps(payload).encode(),
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.read().decode()


def leave(server: VllmServer, rng: random.Random) -> None:
    """A client that goes away: within 50 ms, or after part of a stream (a stream it asked no
    usage chunk of: one that ends before the client leaves is `not_returned`)."""
    host, port = server.base_url.removeprefix("http://").split(":")
    payload = json.dumps({"model": "model", "prompt": "x", "max_tokens": 200,
                          "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(payload)).encode() +
                     b"\r\n\r\n" + payload)
        time.sleep(rng.choice([0.02, 0.05, 0.3, 1.0]))


def processes(server: VllmServer) -> dict[str, psutil.Process]:
    root = psutil.Process(server.pid)
    return {f"{p.name()}[{p.pid}]": p for p in [root, *root.children(recursive=True)]}


def rss_mib(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, proc in procs.items():
        try:
            out[name] = proc.memory_info().rss / 2**20
        except psutil.Error:
            out[name] = math.nan
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8, help="concurrent client threads")
    parser.add_argument("--plugin", choices=("flag", "off"), default="flag",
                        help="off: vLLM alone, for its own memory growth")
    json_option(parser, "soak.json")
    args = parser.parse_args()
    exit_on_sigterm()
    info = header(f"soak: {args.minutes:g} min of mixed traffic, 2 API servers, plugin "
                  f"{args.plugin}")
    plugin = args.plugin != "off"
    options = ServerOptions(model=args.model, plugin=args.plugin,
                            extra_args=["--api-server-count", "2"])
    counts = {"sent": 0, "failed": 0, "left": 0, "without_energy": 0}
    lock = threading.Lock()
    with serving(options, RESULTS / f"soak-{args.plugin}.log") as server:
        time.sleep(2)
        before = server.get_text("/metrics")
        procs = processes(server)
        rss = [rss_mib(procs)]
        start = time.monotonic()
        deadline = start + args.minutes * 60

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                try:
                    if rng.random() < 0.15:
                        leave(server, rng)
                        with lock:
                            counts["left"] += 1
                        continue
                    path, payload = body(rng)
                    shared = "soak-shared-id" if rng.random() < 0.2 else None
                    text = send(server, path, payload, shared)
                    has = '"energy"' in text
                    with lock:
                        counts["sent"] += 1
                        counts["without_energy"] += int(plugin and not has)
                except (urllib.error.URLError, OSError, ValueError) as exc:
                    with lock:
                        counts["failed"] += 1
                    print(f"request failed: {type(exc).__name__}: {exc}", flush=True)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        minute = 1
        while any(t.is_alive() for t in threads):
            threads[0].join(timeout=1.0)
            if time.monotonic() - start >= 60 * minute and time.monotonic() < deadline:
                rss.append(rss_mib(procs))
                minute += 1
        for t in threads:
            t.join()
        rss.append(rss_mib(procs))
        time.sleep(2.0)  # idle: the engine's last counts, the API servers' expiries
        after = server.get_text("/metrics")
    print(f"requests: {counts}")
    results: dict[str, Any] = {"counts": counts, "rss_mib_by_minute": rss}
    ok = counts["failed"] == 0
    if plugin:
        books = energy_books(before, after)
        results.update(books)
        ok = ok and counts["without_energy"] == 0 and books["conservation_error"] <= 1e-9
    for name in rss[0]:
        series = " ".join(f"{row[name]:.0f}" for row in rss)
        print(f"RSS {name} by minute (MiB): {series} ({rss[-1][name] - rss[0][name]:+.1f})")
    finish_run(info, args, results)
    return 0 if ok else 1


def energy_books(before: str, after: str) -> dict[str, Any]:
    """The plugin's books over the run, printed: outcomes, conservation, tracked state."""
    outcomes = {k: v - by_label(before, "piep_request_outcome_joules_total", "outcome").get(k, 0)
                for k, v in by_label(after, "piep_request_outcome_joules_total",
                                     "outcome").items()}
    engine = total(after, "piep_engine_step_joules_total") - total(
        before, "piep_engine_step_joules_total")
    error = abs(math.fsum(outcomes.values()) - engine) / engine if engine else math.nan
    tracked = by_label(after, "piep_tracked_requests", "where")
    engine_tracked = by_label(after, "piep_engine_tracked_requests", "engine")
    print(f"outcomes (J): {json.dumps({k: round(v, 6) for k, v in outcomes.items()})}")
    print(f"conservation error: {error:.2e} (target 1e-9): "
          f"{'PASS' if error <= 1e-9 else 'MISS'}")
    print(f"tracked once idle: {tracked} engines: {engine_tracked}")
    return {"outcomes": outcomes, "engine_joules": engine, "conservation_error": error,
            "tracked": tracked, "engine_tracked": engine_tracked}


if __name__ == "__main__":
    raise SystemExit(main())
