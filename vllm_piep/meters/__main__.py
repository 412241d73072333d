"""Measure this machine's energy over a few seconds, or over a command, with one of the meters.

    python -m vllm_piep.meters --meter auto --seconds 5 [--interval 0.5] [--json]
    python -m vllm_piep.meters --meter auto [--csv runs.csv] [--json-file run.json] -- CMD ARGS
    python -m vllm_piep.meter ...    (the same command)

`--meter` takes every form the serving option `meter` takes: auto, nvml, amdsmi, rapl,
nvml+rapl, cpu-estimate, simulated, external:PATH (a wall meter's CSV log stamped in Unix epoch
seconds on this host's clock) or module:callable (returning a Meter); and `external` with
`--external-log PATH` (a log stamped on this host's monotonic clock, or shifted by
`--clock-offset-s`).

Prints which meter ran (and why, for auto), whether it measures or estimates, then the mean
watts and the joules per device and in total: everything the metered devices drew over the
window (whole GPUs, whole CPU sockets), other processes' load on them included, which the
report says (`covers`). With `-- CMD ARGS` it runs the command, measures
from its start to its exit (like CodeCarbon's `monitor --` or a Zeus window), prints the
report on stderr so that the command's own output stays on stdout, and exits with the
command's exit code; Ctrl-C is passed on to the command. `--csv` appends one row per run
(start, end, seconds, joules, watts, meter, source, exit code, command), `--json-file` writes
the whole record. Bad input exits 2 with one line; so does a meter that cannot run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vllm_piep.cli_errors import (
    HelpFormatter,
    OneLineParser,
    UsageError,
    existing_file,
    output_file,
    run_cli,
)
from vllm_piep.meters.auto import auto_meter, make_meter
from vllm_piep.meters.common import Meter, MeterError, MeterReading, WindowEnergy
from vllm_piep.meters.external import ExternalLogMeter
from vllm_piep.meters.setting import MeterSetting, parse_meter_setting

PROG = "python -m vllm_piep.meters"
CSV_COLUMNS = ("start", "end", "seconds", "joules", "watts", "meter", "source", "exit_code",
               "command")
_LOG_CATCH_UP_S = 2.0  # how long an external log may lag behind the window's end


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: expected a positive number of seconds")
    return value


def _meter(text: str) -> str:
    """An argparse type: a meter as the serving option `meter` spells it, or `external` (its
    log given by --external-log)."""
    if text.strip().lower() == "external":
        return "external"
    try:
        parse_meter_setting(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--meter", default="auto", type=_meter, metavar="METER",
                   help="auto, nvml, amdsmi (AMD SMI), rapl, nvml+rapl, cpu-estimate, "
                        "simulated, external:PATH, module:callable, or external with "
                        "--external-log; auto picks NVML, else AMD SMI, else RAPL, else the "
                        "CPU estimate")
    p.add_argument("--seconds", type=_positive, default=None,
                   help="how long to measure (s) without a command (default: 5; with a "
                        "command, until it exits)")
    p.add_argument("--interval", type=_positive, default=0.5,
                   help="read the meter every this many seconds while waiting (s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (without a command)")
    p.add_argument("--csv", type=Path, default=None, metavar="PATH",
                   help="append one row per run to this CSV (header written when new)")
    p.add_argument("--json-file", type=Path, default=None, metavar="PATH",
                   help="write the run's record to this JSON file")
    p.add_argument("--rapl-root", default=None, help="powercap root (default: /sys/class/powercap)")
    p.add_argument("--proc-stat", default=None,
                   help="/proc/stat path for cpu-estimate (default: /proc/stat)")
    p.add_argument("--external-log", default=None, metavar="PATH",
                   help="power log (CSV timestamp,watts) for --meter external")
    p.add_argument("--clock-offset-s", type=float, default=0.0,
                   help="external log clock minus this host's clock (s), for --meter external")
    return p


def _build(args: argparse.Namespace) -> tuple[Meter, str]:
    setting = _setting(args.meter)
    if setting.kind != "name":
        return _build_from_setting(args, setting), f"requested with --meter {args.meter}"
    name = setting.name  # lower case, as serving reads it
    rapl_kw = {} if args.rapl_root is None else {"root": args.rapl_root}
    cpu_kw = {} if args.proc_stat is None else {"proc_stat": args.proc_stat}
    if name == "auto":
        kw: dict[str, Any] = {"cpu_kw": cpu_kw}
        if args.rapl_root is not None:
            kw["rapl_root"] = args.rapl_root
        return auto_meter(**kw)
    kw = (rapl_kw if name == "rapl" else cpu_kw if name in ("cpu-estimate", "cpu") else {})
    if name == "external":
        if not args.external_log:
            raise UsageError("--meter external needs --external-log PATH (the power log)")
        existing_file(args.external_log, "power log")
        kw = {"path": args.external_log, "clock_offset_s": args.clock_offset_s}
    return make_meter(name, **kw), f"requested with --meter {args.meter}"


def _setting(text: str) -> MeterSetting:
    """`--meter` read as the serving option reads it; bare `external` is a name here."""
    return MeterSetting("name", "external") if text == "external" else parse_meter_setting(text)


def _build_from_setting(args: argparse.Namespace, setting: MeterSetting) -> Meter:
    """An `external:PATH` or `module:callable` meter, built as serving builds it."""
    from vllm_piep.meters.factory import meter_factory

    if setting.kind == "external":
        if args.external_log or args.clock_offset_s:
            raise UsageError(f"--meter {args.meter} reads its log as serving does (Unix epoch "
                             "seconds on this host's clock): --external-log and "
                             "--clock-offset-s go with --meter external")
        existing_file(setting.name, "power log")
        return meter_factory(args.meter)[0]()
    try:
        return meter_factory(args.meter)[0]()
    except Exception as exc:  # noqa: BLE001  (whatever the callable does: say it, as serving)
        raise UsageError(f"--meter {args.meter} cannot be used: {type(exc).__name__}: "
                         f"{exc}") from None


def _wait(meter: Meter, until: Any, interval: float, total: float | None, quiet: bool) -> None:
    """Read the meter every `interval` until `until()` is true, with a progress bar (a bar to
    `total` seconds, or elapsed time for a command)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    began = time.monotonic()
    with Progress(TextColumn("measuring"), BarColumn(), TimeElapsedColumn(),
                  transient=True, disable=quiet) as bar:
        task = bar.add_task("measure", total=total)
        while not until():
            time.sleep(interval if total is None
                       else max(0.0, min(interval, total - (time.monotonic() - began))))
            meter.read()  # keeps wrap-around counters (RAPL) read often enough
            bar.update(task, completed=time.monotonic() - began)


def _window(meter: Meter, first: MeterReading, last: MeterReading) -> WindowEnergy:
    """The window's energy; an external log must hold samples over all of it (a log that
    stopped, or never started, is an error, not 0 J)."""
    if not isinstance(meter, ExternalLogMeter):
        return meter.window(first, last, allow_short=True)
    deadline = time.monotonic() + max(_LOG_CATCH_UP_S, 2 * meter.resolution_s)
    while True:
        meter.refresh()
        span = meter.span_ns
        if (span is not None and span[1] >= last.t_ns) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if span is None:
        raise UsageError(f"{meter.path}: the power log holds no samples")
    joules = meter.energy_between(first.t_ns, last.t_ns)  # names the gap when not covered
    return WindowEnergy((last.t_ns - first.t_ns) / 1e9, {meter.device: joules}, meter.name,
                        meter.source)


def _measure(meter: Meter, args: argparse.Namespace, command: list[str]
             ) -> tuple[WindowEnergy, int | None, datetime, datetime]:
    quiet = args.json or not sys.stderr.isatty()
    meter.start()
    try:
        first = meter.read()
        started = datetime.now(UTC)
        if not command:
            seconds = args.seconds or 5.0
            deadline = time.monotonic() + seconds
            _wait(meter, lambda: time.monotonic() >= deadline, args.interval, seconds, quiet)
            code = None
        else:
            code = _run_command(meter, command, args.interval, quiet)
        last = meter.read()
        ended = datetime.now(UTC)
    finally:
        meter.stop()
    return _window(meter, first, last), code, started, ended


def _in_terminal_foreground() -> bool:
    """Whether this process is in its terminal's foreground group: a Ctrl-C there reaches the
    command directly, and passing it on would deliver it twice."""
    try:
        return os.getpgrp() == os.tcgetpgrp(sys.stdin.fileno())
    except (OSError, ValueError):
        return False


def _run_command(meter: Meter, command: list[str], interval: float, quiet: bool) -> int:
    """Run the command to its end, passing SIGINT and SIGTERM sent to this process on; its exit
    code (128+N when a signal N ended it, as shells report). The handler is in place before
    the command starts: a signal that comes while it is being started reaches it once it
    runs."""
    child: subprocess.Popen[bytes] | None = None
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            pending.append(signum)
        elif child.poll() is None and not (signum == signal.SIGINT
                                           and _in_terminal_foreground()):
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            child = subprocess.Popen(command)
        except OSError as exc:
            raise UsageError(f"{command[0]}: cannot run the command: "
                             f"{exc.strerror or exc}") from exc
        for signum in pending:
            forward(signum, None)
        started = child
        _wait(meter, lambda: started.poll() is not None, min(interval, 0.1), None, quiet)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = started.wait()
    return 128 - code if code < 0 else code


def covers(command: list[str]) -> str:
    """What the figures are: the devices' energy over the window, not a process's."""
    if command:
        return ("the metered devices' energy over the command's run, other processes' load on "
                "them included: not the command's alone")
    return "the metered devices' energy over the window, every process's load on them included"


def _record(meter: Meter, why: str, win: WindowEnergy, code: int | None, started: datetime,
            ended: datetime, command: list[str]) -> dict[str, Any]:
    kinds = {d.name: d.kind for d in meter.devices()}
    watts = win.watts
    return {
        "start": started.isoformat(), "end": ended.isoformat(), "seconds": win.seconds,
        "joules": win.total, "watts": win.total / win.seconds if win.seconds > 0 else 0.0,
        "meter": meter.name, "source": win.source, "why": why, "covers": covers(command),
        "exit_code": code, "command": command or None,
        "devices": {d: {"kind": kinds.get(d, "?"), "joules": j, "watts": watts.get(d, 0.0)}
                    for d, j in win.joules.items()},
    }


def _check_csv(path: Path) -> None:
    """Refuse, before measuring, a CSV that exists with other columns than this tool's."""
    output_file(path, "--csv")
    if path.is_file() and path.stat().st_size > 0:
        try:
            with path.open(newline="") as f:
                header = next(csv.reader(f), [])
        except UnicodeDecodeError:
            header = ["(not text)"]
        if tuple(header) != CSV_COLUMNS:
            raise UsageError(f"{path}: its header {header} is not this tool's "
                             f"{list(CSV_COLUMNS)}; give a new file")


def _append_csv(path: Path, record: dict[str, Any]) -> None:
    new = not path.exists() or path.stat().st_size == 0
    row = dict(record, command=" ".join(record["command"] or []))
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)


def _print_table(record: dict[str, Any], out: Any) -> None:
    kind = {"measured": "measured", "estimated": "ESTIMATED (not a measurement)",
            "simulated": "SIMULATED (not this machine)"}[record["source"]]
    print(f"meter: {record['meter']} -- {kind}", file=out)
    print(f"why: {record['why']}", file=out)
    if record["command"]:
        print(f"command: {' '.join(record['command'])} (exit {record['exit_code']})", file=out)
    print(f"window: {record['seconds']:.3f} s", file=out)
    print(f"energy: {record['covers']}", file=out)
    devices = record["devices"]
    width = max([len(d) for d in devices] + [5])
    print(f"{'device':<{width}}  {'kind':<6} {'mean W':>10} {'joules':>12}", file=out)
    for d, v in devices.items():
        print(f"{d:<{width}}  {v['kind']:<6} {v['watts']:>10.2f} {v['joules']:>12.3f}", file=out)
    print(f"{'total':<{width}}  {'':<6} {record['watts']:>10.2f} {record['joules']:>12.3f}",
          file=out)


def run(args: argparse.Namespace, command: list[str]) -> int:
    if command and args.seconds is not None:
        raise UsageError("--seconds measures a fixed window; with a command the window is the "
                         "command's run: give one or the other")
    if command and args.json:
        raise UsageError("--json prints on stdout, which is the command's: use --json-file PATH")
    if args.csv is not None:
        _check_csv(args.csv)
    if args.json_file is not None:
        output_file(args.json_file, "--json-file")
    try:
        meter, why = _build(args)
        win, code, started, ended = _measure(meter, args, command)
    except MeterError as exc:  # its message names the meter, or it is named here
        text, name = str(exc), args.meter.partition(":")[0]
        raise UsageError(text if text.startswith(f"{name}:") else
                         f"{args.meter} meter: {text}") from exc
    record = _record(meter, why, win, code, started, ended, command)
    if args.csv is not None:
        _append_csv(args.csv, record)
    if args.json_file is not None:
        args.json_file.write_text(json.dumps(record, indent=2) + "\n")
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        _print_table(record, sys.stderr if command else sys.stdout)
    return code or 0


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The CLI; `prog` is the command as the user typed it, which names every error line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
        if not command:
            print(f"{prog}: error: nothing after '--': give the command to measure",
                  file=sys.stderr)
            return 2
    args = parser(prog).parse_args(argv)
    return run_cli(prog, lambda: run(args, command))


if __name__ == "__main__":
    sys.exit(main())
