"""Measure this machine's power for a few seconds with one of the meters.

    python -m vllm_piep.meters --meter auto --seconds 5 [--interval 0.5] [--json]

Prints which meter ran (and why, for auto), whether it measures or estimates, then the mean
watts and the joules per device and in total. Exits 2 with the reason when the meter cannot run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from vllm_piep.meters.auto import METER_NAMES, auto_meter, make_meter
from vllm_piep.meters.common import Meter, MeterError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_piep.meters", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--meter", default="auto", choices=METER_NAMES)
    p.add_argument("--seconds", type=float, default=5.0, help="how long to measure (s)")
    p.add_argument("--interval", type=float, default=0.5,
                   help="read the meter every this many seconds while waiting (s)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--rapl-root", default=None, help="powercap root (default /sys/class/powercap)")
    p.add_argument("--proc-stat", default=None, help="/proc/stat path for cpu-estimate")
    p.add_argument("--external-log", default=None, help="power log file for --meter external")
    p.add_argument("--clock-offset-s", type=float, default=0.0,
                   help="external log clock minus this host's clock (s), for --meter external")
    return p


def _build(args: argparse.Namespace) -> tuple[Meter, str]:
    rapl_kw = {} if args.rapl_root is None else {"root": args.rapl_root}
    cpu_kw = {} if args.proc_stat is None else {"proc_stat": args.proc_stat}
    if args.meter == "auto":
        kw = {"cpu_kw": cpu_kw}
        if args.rapl_root is not None:
            kw["rapl_root"] = args.rapl_root
        return auto_meter(**kw)
    kw: dict[str, object] = (rapl_kw if args.meter == "rapl" else
                             cpu_kw if args.meter == "cpu-estimate" else {})
    if args.meter == "external":
        if not args.external_log:
            raise MeterError("--meter external needs --external-log PATH (the power log)")
        kw = {"path": args.external_log, "clock_offset_s": args.clock_offset_s}
    return make_meter(args.meter, **kw), f"requested with --meter {args.meter}"


def _wait(meter: Meter, seconds: float, interval: float, quiet: bool) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    deadline = time.monotonic() + seconds
    with Progress(TextColumn("measuring"), BarColumn(), TimeRemainingColumn(),
                  transient=True, disable=quiet) as bar:
        task = bar.add_task("measure", total=seconds)
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(interval, left))
            meter.read()  # keeps wrap-around counters (RAPL) read often enough
            bar.update(task, completed=seconds - max(0.0, deadline - time.monotonic()))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.seconds <= 0 or args.interval <= 0:
        print("error: --seconds and --interval must be positive", file=sys.stderr)
        return 2
    try:
        meter, why = _build(args)
        meter.start()
        try:
            first = meter.read()
            _wait(meter, args.seconds, args.interval, quiet=args.json or not sys.stderr.isatty())
            last = meter.read()
        finally:
            meter.stop()
        win = meter.window(first, last, allow_short=True)
    except MeterError as exc:
        print(f"error: {args.meter} meter: {exc}", file=sys.stderr)
        return 2
    kinds = {d.name: d.kind for d in meter.devices()}
    watts = win.watts
    if args.json:
        print(json.dumps({
            "meter": meter.name, "why": why, "source": win.source, "seconds": win.seconds,
            "devices": {d: {"kind": kinds.get(d, "?"), "joules": j, "watts": watts.get(d, 0.0)}
                        for d, j in win.joules.items()},
            "total_joules": win.total,
            "total_watts": win.total / win.seconds if win.seconds > 0 else 0.0,
        }, indent=2))
        return 0
    kind = {"measured": "measured", "estimated": "ESTIMATED (not a measurement)",
            "simulated": "SIMULATED (not this machine)"}[win.source]
    print(f"meter: {meter.name} -- {kind}")
    print(f"why: {why}")
    print(f"window: {win.seconds:.3f} s")
    width = max([len(d) for d in win.joules] + [5])
    print(f"{'device':<{width}}  {'kind':<6} {'mean W':>10} {'joules':>12}")
    for d, j in win.joules.items():
        print(f"{d:<{width}}  {kinds.get(d, '?'):<6} {watts.get(d, 0.0):>10.2f} {j:>12.3f}")
    total_w = win.total / win.seconds if win.seconds > 0 else 0.0
    print(f"{'total':<{width}}  {'':<6} {total_w:>10.2f} {win.total:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
