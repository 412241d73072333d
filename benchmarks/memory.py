"""Resident memory the plugin adds to each process of a served model, side by side in one run.

A plain `vllm serve`, one with `--plugins piep` (the analytic prior), and one with the plugin
and the shipped calibrated bundle (`--additional-config '{"piep": {"bundle": ...}}'`) take turns
A B C A B C (one server at a time). Each is warmed up with the same fixed streamed workload
(so the plugin's per-request state, onnxruntime sessions and lazy imports exist), left to settle,
then every process of its tree is sampled with psutil: RSS, USS and PSS
(`memory_full_info`, where /proc/PID/smaps is readable) and peak RSS (VmHWM). Processes are
named by their title: `api-server` (the `vllm serve` process), `EngineCore`, `Worker`,
`resource-tracker`. Reported per role: the mean over rounds of each variant and the difference
variant - plain in MB (10^6 bytes); target: RSS added <= 50 MB per process (the verdict; USS is
what the process alone holds; PSS shares pages among every process mapping them, so it moves
with whatever else runs on the machine).

    .venv/bin/python benchmarks/memory.py --model .cache/tiny-llama --rounds 2 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_overhead import (  # noqa: E402
    RESULTS,
    ROOT,
    finish_run,
    header,
    json_option,
    role_of,
    run_load,
    serving,
    verdict,
    workload,
)

from vllm_piep.tools.server import ServerOptions, exit_on_sigterm  # noqa: E402

TARGET_MB = 50.0
MB = 1e6
FIELDS = ("rss", "uss", "pss", "peak_rss")


def variants(model: str, bundle: str) -> dict[str, ServerOptions]:
    config = json.dumps({"piep": {"bundle": bundle}})
    return {"plain": ServerOptions(model=model, plugin="off"),
            "piep": ServerOptions(model=model, plugin="flag"),
            "piep-bundle": ServerOptions(model=model, plugin="flag",
                                         extra_args=("--additional-config", config))}


def peak_rss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) * 1024
    return float("nan")


def sample_tree(root_pid: int) -> dict[str, dict[str, float]]:
    """Bytes per role (RSS, USS, PSS, peak RSS) of the server's process tree."""
    root = psutil.Process(root_pid)
    seen: Counter[str] = Counter()
    out: dict[str, dict[str, float]] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            role = role_of(proc, root_pid)
            try:
                full = proc.memory_full_info()
                mem = {"rss": full.rss, "uss": full.uss, "pss": full.pss}
            except psutil.AccessDenied:  # smaps unreadable: RSS only
                mem = {"rss": proc.memory_info().rss, "uss": float("nan"), "pss": float("nan")}
            mem["peak_rss"] = peak_rss(proc.pid)
        except (psutil.NoSuchProcess, OSError):
            continue
        seen[role] += 1
        out[role if seen[role] == 1 else f"{role}#{seen[role]}"] = {k: float(v)
                                                                    for k, v in mem.items()}
    return out


def measure(options: ServerOptions, bodies: list[dict[str, Any]], concurrency: int,
            settle_s: float, log: Path) -> tuple[dict[str, dict[str, float]], list[str | None]]:
    """Start, warm up, settle, sample the tree (three times, 1 s apart: the median), stop."""
    with serving(options, log) as server:
        assert server.pid is not None
        _, streams = asyncio.run(run_load(server.base_url, bodies, concurrency))
        time.sleep(settle_s)  # freed buffers returned, background threads idle
        samples = []
        for _ in range(3):
            samples.append(sample_tree(server.pid))
            time.sleep(1.0)
    roles = samples[0].keys()
    tree = {role: {f: statistics.median(s[role][f] for s in samples if role in s)
                   for f in FIELDS} for role in roles}
    return tree, [s.energy_source for s in streams]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant and role, the mean over rounds; per role, each variant minus plain."""
    means: dict[str, dict[str, dict[str, float]]] = {}
    for name in dict.fromkeys(r["variant"] for r in rounds):
        trees = [r["tree"] for r in rounds if r["variant"] == name]
        roles = dict.fromkeys(role for t in trees for role in t)
        means[name] = {role: {f: statistics.fmean(t[role][f] for t in trees if role in t)
                              for f in FIELDS} for role in roles}
    added: dict[str, dict[str, dict[str, Any]]] = {}
    for name, tree in means.items():
        if name == "plain":
            continue
        added[name] = {}
        for role, mem in tree.items():
            base = means["plain"].get(role)
            if base is None:  # a process the plain server does not have: all of it is added
                base = dict.fromkeys(FIELDS, 0.0)
            diff = {f: (mem[f] - base[f]) / MB for f in FIELDS}
            added[name][role] = diff | {"verdict": verdict(diff["rss"] <= TARGET_MB)}
    return {"mean_mb": {n: {r: {f: v / MB for f, v in m.items()} for r, m in t.items()}
                        for n, t in means.items()},
            "added_mb": added}


def print_report(summary: dict[str, Any], rounds: list[dict[str, Any]]) -> None:
    print("\nper round (MB, RSS / USS / PSS / peak RSS):")
    for r in rounds:
        sources = Counter(r["energy_sources"])
        print(f"  round {r['round']} {r['variant']:<11} usage.energy sources "
              f"{dict(sources)}")
        for role, mem in r["tree"].items():
            print(f"    {role:<17} " + " / ".join(f"{mem[f] / MB:7.1f}" for f in FIELDS))
    print("\nmean over rounds (MB, RSS / USS / PSS / peak RSS):")
    for name, tree in summary["mean_mb"].items():
        for role, mem in tree.items():
            print(f"  {name:<11} {role:<17} " + " / ".join(f"{mem[f]:7.1f}" for f in FIELDS))
    print("\nadded by the plugin per process, variant - plain "
          f"(MB; target RSS <= {TARGET_MB:.0f}):")
    for name, tree in summary["added_mb"].items():
        for role, d in tree.items():
            print(f"  {name:<11} {role:<17} RSS {d['rss']:+7.1f}  USS {d['uss']:+7.1f}  "
                  f"PSS {d['pss']:+7.1f}  peak RSS {d['peak_rss']:+7.1f}   {d['verdict']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--bundle", default=str(ROOT / "models" / "cpu-tiny-llama"))
    parser.add_argument("--variants", default="plain,piep,piep-bundle",
                        help="which servers, in this order every round (plain is required)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=128, help="warm-up streamed requests")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds between the warm-up and the samples")
    json_option(parser, "memory.json")
    args = parser.parse_args()
    exit_on_sigterm()
    names = [v for v in args.variants.split(",") if v.strip()]
    options = variants(args.model, args.bundle)
    if "plain" not in names or set(names) - set(options):
        parser.error(f"--variants: plain plus any of {sorted(options)}")
    info = header("memory added per process by the plugin, A B C A B C")
    print(f"warm-up: {args.requests} streamed requests x {args.max_tokens} tokens at "
          f"concurrency {args.concurrency}; variants {names}, {args.rounds} rounds", flush=True)

    bodies = workload(args.requests, seed=0, max_tokens=args.max_tokens)  # the same for all
    rounds: list[dict[str, Any]] = []
    order = [(i, name) for i in range(args.rounds) for name in names]
    for i, name in tqdm(order, desc="servers (A B C A B C)", unit="server"):
        tree, sources = measure(options[name], bodies, args.concurrency, args.settle,
                                RESULTS / f"memory_{name}.log")
        rounds.append({"round": i, "variant": name, "tree": tree, "energy_sources": sources})

    summary = summarize(rounds)
    print_report(summary, rounds)
    finish_run(info, args, {
        "rounds": [r | {"energy_sources": dict(Counter(map(str, r["energy_sources"])))}
                   for r in rounds],
        "target_mb": TARGET_MB, **summary})
    return 0  # a measurement, not a test: a MISS is a result


if __name__ == "__main__":
    sys.exit(main())
