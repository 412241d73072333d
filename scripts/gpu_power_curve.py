#!/usr/bin/env python3
"""How one GPU's power follows its load, read by its own energy counter: the data that decide
the prior's form (docs/prior.md), measured where no published table reaches.

    python3 scripts/gpu_power_curve.py --out DIR [--window 2.0] [--dry-run]
    python3 scripts/gpu_power_curve.py --plot DIR/power_curve.csv --out FILE.png

Three sweeps of bf16 matrix products `[M, 4096] x [4096, 14336]` (one MLP projection of an
8B model), each point held over a window of the counter of at least `--window` seconds:
- intensity: back to back, M from 16 (a decode batch: weight reads, memory-bound) to 16384 (a
  long prefill: compute-bound);
- busy share, compute-bound: M = 16384 in bursts of ~5 ms with the device idle between them
  (the host sleeps), so that kernels run 100 % down to 2 % of the time;
- busy share, memory-bound: M = 64 likewise; and short bursts (0.5 ms) with gaps of 0.5 to
  5 ms, as eager decode launches leave them.
Per point: the counter's watts, the kernels' share of the window (CUDA events around each
burst), FLOP/s and weight bytes/s achieved, the SM clock and NVML's clock event reasons. Idle
power is read first and last. Writes `power_curve.csv` and `power_curve.json` (the GPU, its
driver and limits) under `--out`, a row at a time.

`--dry-run` runs the same code on this machine's CPU against the stand-in `pynvml` of
tests/support (a constant 80 W): it checks the script, and its figures are the stand-in's.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
K, N = 4096, 14336  # the product's inner and output sizes
DRY_K, DRY_N, DRY_M_MAX = 128, 256, 256  # a dry run's, so that a CPU runs it in seconds
INTENSITY_M = (16, 64, 256, 1024, 4096, 16384)
SHARES = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02)
MEMORY_SHARES = (1.0, 0.5, 0.2, 0.1)
SHORT_GAPS_MS = (0.5, 2.0, 5.0)
BURST_MS = 5.0
SHORT_BURST_MS = 0.5


@dataclass
class Point:
    sweep: str
    m: int
    burst_ms: float  # the device's time per burst (measured)
    gap_ms: float  # the host's sleep between bursts (0: back to back)
    window_s: float
    watts: float
    busy_share: float  # kernels' time over the window
    tflops: float  # achieved over the window
    weight_gbps: float  # weight bytes read per second over the window
    sm_clock_mhz: int
    clock_reasons: str


class Load:
    """Bursts of `reps` products of `m` rows, timed by CUDA events (the CPU's clock on a dry
    run), with `gap_s` of host sleep after each."""

    def __init__(self, torch: Any, device: str, m: int) -> None:
        self.torch, self.device, self.m = torch, device, m
        cuda = device == "cuda"
        dtype = torch.bfloat16 if cuda else torch.float32
        k, n, rows = (K, N, m) if cuda else (DRY_K, DRY_N, min(m, DRY_M_MAX))
        self.flops, self.weight_bytes = 2.0 * rows * k * n, 2.0 * k * n  # per product (bf16)
        self.a = torch.randn(rows, k, device=device, dtype=dtype)
        self.w = torch.randn(k, n, device=device, dtype=dtype)
        self.c = torch.empty(rows, n, device=device, dtype=dtype)
        self.reps, self.gap_s = 1, 0.0
        self.bursts: list[tuple[int, int, float]] = []  # host start, host end ns, device s

    def burst(self) -> None:
        torch = self.torch
        t0 = time.perf_counter_ns()
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            for _ in range(self.reps):
                torch.matmul(self.a, self.w, out=self.c)
            end.record()
            end.synchronize()
            device_s = start.elapsed_time(end) / 1e3
        else:
            for _ in range(self.reps):
                torch.matmul(self.a, self.w, out=self.c)
            device_s = (time.perf_counter_ns() - t0) / 1e9
        self.bursts.append((t0, time.perf_counter_ns(), device_s))
        if self.gap_s > 0:
            time.sleep(self.gap_s)

    def size_bursts(self, burst_ms: float) -> None:
        """`reps` for bursts of about `burst_ms`."""
        self.reps, self.gap_s = 3, 0.0
        for _ in range(3):
            self.burst()
        one = min(b[2] for b in self.bursts[-2:]) / self.reps
        self.reps = max(1, round(burst_ms / 1e3 / one))
        self.bursts.clear()


def clock_state(nvml: Any, handle: Any) -> tuple[int, str]:
    """The SM clock (MHz, -1 unread) and NVML's clock event reasons, as the GPU check reads
    them."""
    from vllm_piep.tools.gpu_check.prior_section import clock_state as read

    state = read(nvml, handle)
    return state["sm_clock_mhz"] or -1, "+".join(state["clock_reasons"] or ())


WINDOW_TRIES = 3  # a window holding fewer than two whole bursts is tried again, twice as long


def measure(poller: Any, nvml: Any, handle: Any, load: Load | None, sweep: str,
            window_s: float, gap_ms: float) -> Point:
    """One point: the load (None: idle) over a window of the counter that holds at least two
    whole bursts (a burst that a loaded host stretched makes the next window longer)."""
    states: list[tuple[int, str]] = []

    def busy() -> None:
        if load is None:
            time.sleep(0.01)
        else:
            load.burst()
        if len(states) < 1000:
            states.append(clock_state(nvml, handle))

    if load is not None:
        load.bursts.clear()
        for _ in range(3):  # the clocks settle into the load before the window opens
            load.burst()
        # long enough to hold a few whole bursts and gaps
        period = max(b[1] - b[0] for b in load.bursts) / 1e9 + load.gap_s
        window_s = max(window_s, 4 * period)
    for _ in range(WINDOW_TRIES):
        window = poller.window(time.perf_counter_ns(), window_s, timeout_s=10.0, keep_busy=busy)
        start, end = window.start.t_ns, window.end.t_ns
        inside = [b for b in (load.bursts if load is not None else [])
                  if b[0] >= start and b[1] <= end]
        if load is None or len(inside) >= 2:
            break
        window_s *= 2
    else:
        raise RuntimeError(f"fewer than two whole bursts in a window of {window_s / 2:.2f} s")
    device_s = sum(b[2] for b in inside)
    products = (load.reps if load is not None else 0) * len(inside)
    m = load.m if load is not None else 0
    flops = load.flops * products if load is not None else 0.0
    weight_bytes = load.weight_bytes * products if load is not None else 0.0
    mhz, reasons = states[len(states) // 2] if states else clock_state(nvml, handle)
    return Point(sweep, m, device_s / len(inside) * 1e3 if inside else 0.0, gap_ms,
                 window.seconds, window.watts, device_s / window.seconds,
                 flops / window.seconds / 1e12, weight_bytes / window.seconds / 1e9, mhz,
                 reasons)


def plan() -> list[tuple[str, int, float, float]]:
    """(sweep, M, burst ms (0: back to back), share or gap) for every point, in order."""
    points: list[tuple[str, int, float, float]] = [("idle", 0, 0.0, 0.0)]
    points += [("intensity", m, 0.0, 1.0) for m in INTENSITY_M]
    points += [("share, compute-bound", 16384, BURST_MS, s) for s in SHARES[1:]]
    points += [("share, memory-bound", 64, BURST_MS, s) for s in MEMORY_SHARES[1:]]
    points += [("short gaps, memory-bound", 64, SHORT_BURST_MS, g) for g in SHORT_GAPS_MS]
    points.append(("idle", 0, 0.0, 0.0))
    return points


def plot(csv_path: Path, png: Path) -> None:
    """Power against the kernels' share of the time (each sweep), and against M back to back."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    facts_path = csv_path.with_suffix(".json")
    facts = json.loads(facts_path.read_text()) if facts_path.exists() else {}
    rows = pd.read_csv(csv_path)
    idle = rows[rows.sweep == "idle"].watts
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for sweep, marker in (("share, compute-bound", "o"), ("share, memory-bound", "s"),
                          ("short gaps, memory-bound", "^")):
        part = rows[rows.sweep == sweep]
        full = rows[(rows.sweep == "intensity") & (rows.m == part.m.iloc[0])] if len(part) \
            else part
        both = pd.concat([part, full]).sort_values("busy_share")
        left.plot(both.busy_share, both.watts, marker=marker, label=f"{sweep} (M={both.m.iloc[0]})"
                  if len(both) else sweep)
    for i, w in enumerate(idle):
        left.axhline(w, color="grey", lw=0.8, ls=":" if i else "--",
                     label=f"idle {'after the load' if i else 'before'}: {w:.0f} W")
    left.set(xlabel="kernels' share of the time", ylabel="W (the GPU's energy counter)",
             title="power against busy share", xlim=(0, 1.02), ylim=(0, None))
    left.legend(fontsize=8)
    intensity = rows[rows.sweep == "intensity"]
    right.semilogx(intensity.m, intensity.watts, marker="o")
    for m, w, tf in zip(intensity.m, intensity.watts, intensity.tflops, strict=True):
        right.annotate(f"{tf:.0f} TFLOP/s", (m, w), fontsize=7, textcoords="offset points",
                       xytext=(0, -12), ha="center")
    right.axhline(facts.get("power_limit_w", 0) or float("nan"), color="red", lw=0.8, ls="--")
    right.set(xlabel="M (rows of the product), back to back", ylabel="W",
              title=f"power against intensity: [M, {K}] x [{K}, {N}]", ylim=(0, None))
    fig.suptitle(f"{facts.get('gpu', 'GPU')}, driver {facts.get('driver', '?')}"
                 f"{' (DRY RUN: a stand-in, not a GPU)' if facts.get('dry_run') else ''}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="the folder for the CSV and JSON (with --plot: the PNG)")
    parser.add_argument("--plot", type=Path, help="a power_curve.csv to plot, not measure")
    parser.add_argument("--window", type=float, default=2.0, help="seconds per point")
    parser.add_argument("--dry-run", action="store_true",
                        help="this CPU against the stand-in pynvml (checks the script only)")
    args = parser.parse_args()
    if args.plot is not None:
        if not args.plot.is_file():
            print(f"gpu_power_curve: {args.plot}: no such file", file=sys.stderr)
            return 2
        plot(args.plot, args.out)
        return 0
    if args.dry_run:
        sys.path[:0] = [str(ROOT / "tests/support/standin_pynvml"), str(ROOT / "tests/support")]
    sys.path.insert(0, str(ROOT))
    import pynvml
    import torch

    from vllm_piep.tools.gpu_check.counter import CounterPoller

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_power_curve: no CUDA GPU (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    facts = {"gpu": pynvml.nvmlDeviceGetName(handle), "dry_run": args.dry_run,
             "driver": pynvml.nvmlSystemGetDriverVersion(),
             "power_limit_w": pynvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000.0,
             "product": f"[M, {K}] x [{K}, {N}]", "dtype": "bf16" if device == "cuda" else "f32",
             "window_s": args.window, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                time.gmtime())}
    (args.out / "power_curve.json").write_text(json.dumps(facts, indent=1, default=str))
    rows: list[Point] = []
    loads: dict[int, Load] = {}
    with CounterPoller(pynvml, handle) as poller, \
            open(args.out / "power_curve.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(Point.__dataclass_fields__))
        writer.writeheader()
        for sweep, m, burst_ms, x in plan():
            try:
                load = None
                gap_ms = 0.0
                if m:
                    if m not in loads:
                        loads[m] = Load(torch, device, m)
                    load = loads[m]
                    load.size_bursts(burst_ms or 20.0)  # back to back: bursts of ~20 ms
                    if burst_ms:
                        # a share: idle for the planned burst times (1/share - 1); a gap: x ms
                        gap_ms = burst_ms * (1.0 / x - 1.0) if sweep.startswith("share") else x
                        load.gap_s = gap_ms / 1e3
                point = measure(poller, pynvml, handle, load, sweep, args.window, gap_ms)
            except Exception as exc:  # noqa: BLE001  (one point's failure; the next runs)
                print(f"{sweep} M={m}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            rows.append(point)
            writer.writerow(asdict(point))
            f.flush()
            print(f"{point.sweep:26s} M={point.m:6d} burst {point.burst_ms:7.2f} ms "
                  f"gap {point.gap_ms:7.2f} ms  busy {point.busy_share:5.3f}  "
                  f"{point.watts:6.1f} W  {point.tflops:7.1f} TFLOP/s  "
                  f"{point.weight_gbps:7.1f} GB/s  {point.sm_clock_mhz} MHz {point.clock_reasons}",
                  flush=True)
    pynvml.nvmlShutdown()
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
