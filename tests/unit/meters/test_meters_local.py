"""Local meters without hardware: RAPL on a fake powercap tree, the CPU estimate on a fake
/proc/stat, the simulator, auto selection, and the `python -m vllm_piep.meters` CLI. The meters
read a fake clock that only the tests move, and the tests wait for their threads' polls, never
for a time; the CLI runs in a child process only where what it reports does not depend on how
fast this machine runs it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.fake_clock import FakeClock, install
from support.paths import ROOT

from vllm_piep.meters.auto import auto_meter, make_meter
from vllm_piep.meters.common import CompositeMeter, Meter, MeterError, MeterReading
from vllm_piep.meters.cpu_estimate import CpuEstimateMeter
from vllm_piep.meters.rapl import RaplMeter
from vllm_piep.meters.simulated import SimTrace, SimulatedMeter

RANGE_UJ = 262_143_328_850
HANG_S = 60.0  # how long a wait for a meter's thread may take before the test fails


class ThreadReads:
    """`clock` as a meter reads it, counting the reads its poll thread `thread` makes: a read
    counted after an event belongs to a poll begun after it."""

    def __init__(self, clock: FakeClock, thread: str) -> None:
        self.clock, self.thread, self.count = clock, thread, 0

    def __call__(self) -> int:
        if threading.current_thread().name == self.thread:
            self.count += 1
        return self.clock()

    def wait_for_a_poll(self) -> None:
        """Until a poll begun after this call has ended (the next one has begun)."""
        target = self.count + 2
        deadline = time.monotonic() + HANG_S
        while self.count < target:
            assert time.monotonic() < deadline, f"no poll of {self.thread}"
            time.sleep(0.001)


def _zone(path: Path, name: str, energy: int, rng: int = RANGE_UJ) -> Path:
    path.mkdir(parents=True)
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{energy}\n")
    (path / "max_energy_range_uj").write_text(f"{rng}\n")
    return path


@pytest.fixture
def powercap(tmp_path: Path) -> Path:
    """package-0 with dram, core and uncore subzones (nested, as under the device dir), and
    the empty `intel-rapl` control-type dir real sysfs also has."""
    root = tmp_path / "powercap"
    (root / "intel-rapl").mkdir(parents=True)
    pkg = _zone(root / "intel-rapl:0", "package-0", 1_000_000)
    _zone(pkg / "intel-rapl:0:0", "core", 5)
    _zone(pkg / "intel-rapl:0:1", "uncore", 5)
    _zone(pkg / "intel-rapl:0:2", "dram", 2_000_000, rng=65_532_610_987)
    return root


def _set(root: Path, zone: str, value: int) -> None:
    matches = list(root.rglob(zone))
    assert len(matches) == 1
    (matches[0] / "energy_uj").write_text(f"{value}\n")


def test_rapl_exact_joules(powercap: Path) -> None:
    clock = FakeClock()
    m = RaplMeter(powercap, poll_interval_s=None, clock=clock)
    assert RaplMeter.available(powercap)
    assert [(d.name, d.kind) for d in m.devices()] == [("package-0", "cpu"), ("dram-0", "dram")]
    assert m.source == "measured"
    m.start()
    r0 = m.read()
    assert r0.joules == {"package-0": 0.0, "dram-0": 0.0}
    _set(powercap, "intel-rapl:0", 1_000_000 + 50_000_000)  # +50 J
    _set(powercap, "intel-rapl:0:2", 2_000_000 + 7_500_000)  # +7.5 J
    _set(powercap, "intel-rapl:0:0", 10**9)  # core: ignored
    clock.advance(2.0)
    r1 = m.read()
    assert r1.joules == pytest.approx({"package-0": 50.0, "dram-0": 7.5})
    w = m.window(r0, r1)
    assert w.seconds == 2.0
    assert w.watts == pytest.approx({"package-0": 25.0, "dram-0": 3.75})
    m.stop()


def test_rapl_flat_tree_multiple_packages(tmp_path: Path) -> None:
    """Real /sys/class/powercap symlinks every zone flat into the root."""
    root = tmp_path / "pc"
    _zone(root / "intel-rapl:0", "package-0", 0)
    _zone(root / "intel-rapl:1", "package-1", 0)
    _zone(root / "intel-rapl:1:0", "dram", 0)
    _zone(root / "intel-rapl:2", "psys", 0)  # platform: contains the packages, skipped
    _zone(root / "intel-rapl-mmio:0", "package-0", 0)  # MMIO mirror, skipped
    m = RaplMeter(root, poll_interval_s=None)
    assert [d.name for d in m.devices()] == ["package-0", "package-1", "dram-1"]


def test_rapl_wraparound(powercap: Path) -> None:
    m = RaplMeter(powercap, poll_interval_s=None, clock=FakeClock())
    _set(powercap, "intel-rapl:0", RANGE_UJ - 3_000_000)  # 3 J below the wrap
    m.start()
    _set(powercap, "intel-rapl:0", RANGE_UJ - 1_000_000)  # +2 J
    assert m.read().joules["package-0"] == pytest.approx(2.0)
    _set(powercap, "intel-rapl:0", 4_000_000)  # wrapped: +1 J to the range, +4 J after
    assert m.read().joules["package-0"] == pytest.approx(7.0)
    _set(powercap, "intel-rapl:0", 5_000_000)
    assert m.read().joules["package-0"] == pytest.approx(8.0)
    m.stop()


def test_rapl_unreadable_energy(powercap: Path) -> None:
    energy = powercap / "intel-rapl:0" / "energy_uj"
    if os.geteuid() == 0:  # root reads through chmod 000: make the read fail another way
        energy.unlink()
        energy.mkdir()
    else:
        energy.chmod(0)
    try:
        assert not RaplMeter.available(powercap)
        with pytest.raises(MeterError) as err:
            RaplMeter(powercap)
        msg = str(err.value)
        assert "permission" in msg and "chmod a+r" in msg and "root" in msg
        assert "energy_uj" in msg
    finally:
        if energy.is_file():
            energy.chmod(0o644)


def test_rapl_missing_tree(tmp_path: Path) -> None:
    assert not RaplMeter.available(tmp_path / "nothing")
    with pytest.raises(MeterError, match="no RAPL"):
        RaplMeter(tmp_path / "nothing")


def test_rapl_poll_thread_counts_wraps_between_reads_and_stops(powercap: Path) -> None:
    before = set(threading.enumerate())
    clock = ThreadReads(FakeClock(), "piep-rapl-poll")
    m = RaplMeter(powercap, poll_interval_s=0.01, clock=clock)
    m.start()
    assert len(set(threading.enumerate()) - before) == 1
    # From 1 J the counter climbs to 1 J below its wrap, then wraps to 3 J, with no read() in
    # between: only the poll thread sees the climb (read() alone would see +2 J).
    _set(powercap, "intel-rapl:0", RANGE_UJ - 1_000_000)
    clock.wait_for_a_poll()
    _set(powercap, "intel-rapl:0", 3_000_000)
    clock.wait_for_a_poll()
    m.stop()
    assert set(threading.enumerate()) == before
    assert m.read().joules["package-0"] == pytest.approx(RANGE_UJ / 1e6 + 2.0, abs=1e-6)


# ------------------------------------------------------------------------------- CPU estimate

def _stat(path: Path, busy: int, idle: int, cpus: int = 4) -> None:
    """Aggregate line: user=busy/2, system=busy/2, idle=idle-1, iowait=1 (idle includes it)."""
    lines = [f"cpu  {busy // 2} 0 {busy - busy // 2} {idle - 1} 1 0 0 0 0 0"]
    lines += [f"cpu{i} 1 0 1 1 0 0 0 0 0 0" for i in range(cpus)]
    path.write_text("\n".join(lines + ["intr 1 2 3", "ctxt 42"]) + "\n")


def test_cpu_estimate_exact(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    _stat(stat, busy=1000, idle=1000)
    clock = FakeClock()
    m = CpuEstimateMeter(proc_stat=stat, cpuinfo=tmp_path / "nope", sampler=False, clock=clock)
    # default TDP: 10 W per logical CPU (profiles.cpu_spec), 30 % static
    assert m.tdp_watts == 40.0 and m.static_fraction == 0.3
    assert m.source == "estimated" and m.resolution_s == 0.1
    assert [(d.name, d.kind) for d in m.devices()] == [("cpu-estimate", "cpu")]
    m.start()
    # 1 s at 25 % busy: P = 40 * (0.3 + 0.7 * 0.25) = 19 W
    _stat(stat, busy=1000 + 100, idle=1000 + 300)
    clock.advance(1.0)
    assert m.sample() == pytest.approx(19.0)
    assert m.read().joules["cpu-estimate"] == pytest.approx(19.0)
    # 2 s at 100 % busy: 40 W -> +80 J
    _stat(stat, busy=1100 + 400, idle=1300)
    clock.advance(2.0)
    m.sample()
    r = m.read()
    assert r.joules["cpu-estimate"] == pytest.approx(99.0)
    # between samples read() extrapolates with the last sample's power
    clock.advance(0.5)
    assert m.read().joules["cpu-estimate"] == pytest.approx(99.0 + 20.0)
    m.stop()


def test_cpu_estimate_tdp_sources(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    _stat(stat, busy=0, idle=10, cpus=2)
    assert CpuEstimateMeter(tdp_watts=123, proc_stat=stat).tdp_watts == 123.0
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7763 64-Core Processor\n"
                    "physical id\t: 0\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7763 64-Core "
                    "Processor\nphysical id\t: 1\n")
    m = CpuEstimateMeter(proc_stat=stat, cpuinfo=info)
    assert m.tdp_watts == 560.0 and "7763" in m.tdp_source


def test_cpu_estimate_sampler_thread_stops(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    _stat(stat, busy=0, idle=10)
    before = set(threading.enumerate())
    fake = FakeClock()
    clock = ThreadReads(fake, "piep-cpu-estimate")
    m = CpuEstimateMeter(proc_stat=stat, cpuinfo=tmp_path / "nope", period_s=0.01, clock=clock)
    m.start()
    assert len(set(threading.enumerate()) - before) == 1
    fake.advance(0.05)
    clock.wait_for_a_poll()
    m.stop()
    assert set(threading.enumerate()) == before
    # no jiffy moved in the fake /proc/stat: idle power, the static 30 % of 40 W, for 50 ms
    assert m.read().joules["cpu-estimate"] == pytest.approx(0.3 * 40.0 * 0.05, rel=1e-12)


def test_cpu_estimate_unavailable(tmp_path: Path) -> None:
    assert not CpuEstimateMeter.available(tmp_path / "missing")
    with pytest.raises(MeterError):
        CpuEstimateMeter(proc_stat=tmp_path / "missing")


# ---------------------------------------------------------------------------------- simulator

def test_simulator_closed_form() -> None:
    clock = FakeClock()
    tr = SimTrace(100.0, 40.0, 4.0, "gpu")
    m = SimulatedMeter({"g": tr, "c": SimTrace(10.0, kind="cpu")}, clock=clock)
    assert m.available() and m.source == "simulated"
    m.start()
    assert m.read().joules == {"g": 0.0, "c": 0.0}
    clock.advance(1.0)  # quarter period: 100*1 + 40*4/(2pi)*(1 - cos(pi/2))
    r1 = m.read()
    assert r1.joules["g"] == pytest.approx(100.0 + 160.0 / (2 * math.pi))
    assert r1.joules["c"] == pytest.approx(10.0)
    clock.advance(3.0)  # a whole period: the sine integrates to zero
    assert m.read().joules["g"] == pytest.approx(400.0)
    # numerically integrate watts(t) as a cross-check of the closed form
    n = 10_000
    integral = sum(tr.watts((i + 0.5) * 2.5 / n) for i in range(n)) * 2.5 / n
    assert tr.joules(2.5) == pytest.approx(integral, rel=1e-6)


# ----------------------------------------------------------------------------- auto / by name

def test_auto_picks_rapl_without_nvml(powercap: Path) -> None:
    m, why = auto_meter(nvml_available=False, rapl_root=powercap,
                        rapl_kw={"poll_interval_s": None})
    assert isinstance(m, RaplMeter) and "RAPL" in why


def test_auto_picks_cpu_estimate_otherwise(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    _stat(stat, busy=0, idle=10)
    m, why = auto_meter(nvml_available=False, rapl_root=tmp_path / "none",
                        cpu_kw={"proc_stat": stat})
    assert isinstance(m, CpuEstimateMeter) and "estimated" in why
    assert not isinstance(m, SimulatedMeter)


class _FakeNvml(SimulatedMeter):
    name = "nvml"
    source = "measured"


def test_auto_meters_the_gpus_alone_and_says_which(powercap: Path, tmp_path: Path) -> None:
    """RAPL reads the whole CPU socket, other processes' work included: with a GPU it is added
    only when asked for (`nvml+rapl`), and auto's reason names the GPUs and says so."""
    def fake() -> Meter:
        return _FakeNvml({"gpu0": SimTrace(100.0)})

    m, why = auto_meter(nvml_factory=fake, nvml_available=True, rapl_root=powercap,
                        rapl_kw={"poll_interval_s": None})
    assert isinstance(m, _FakeNvml) and [d.name for d in m.devices()] == ["gpu0"]
    assert "GPUs gpu0" in why and "CPU socket is not included" in why and "nvml+rapl" in why
    m2, why2 = auto_meter(nvml_factory=fake, nvml_available=True, rapl_root=tmp_path / "none")
    assert isinstance(m2, _FakeNvml) and "CPU energy is not measured" in why2


def test_nvml_plus_rapl_sums_the_gpus_and_the_socket(powercap: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_piep.meters import auto

    monkeypatch.setattr(auto, "_nvml_class", lambda: lambda **kw: _FakeNvml(
        {"gpu0": SimTrace(100.0)}))
    m = make_meter("nvml+rapl", rapl_kw={"root": powercap, "poll_interval_s": None})
    assert isinstance(m, CompositeMeter) and m.source == "measured"
    assert [d.name for d in m.devices()] == ["gpu0", "package-0", "dram-0"]


def test_auto_without_nvml_module_never_simulates(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    _stat(stat, busy=0, idle=10)
    m, _ = auto_meter(rapl_root=tmp_path / "none", cpu_kw={"proc_stat": stat})
    assert m.source != "simulated"


def test_make_meter_names(tmp_path: Path) -> None:
    assert isinstance(make_meter("simulated"), SimulatedMeter)
    with pytest.raises(MeterError) as err:
        make_meter("bogus")
    for name in ("auto", "nvml", "rapl", "cpu-estimate", "simulated", "external"):
        assert name in str(err.value)
    with pytest.raises(MeterError):
        make_meter("rapl", root=tmp_path / "none")


def test_meter_reading_roundtrip_types() -> None:
    m: Meter = SimulatedMeter(clock=FakeClock())
    m.start()
    assert isinstance(m.read(), MeterReading)


# ------------------------------------------------------------------------------------- CLI

def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_piep.meters", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def test_cli_simulated() -> None:
    p = _cli("--meter", "simulated", "--seconds", "0.5", "--interval", "0.1")
    assert p.returncode == 0, p.stderr
    assert "simulated" in p.stdout and "sim-gpu0" in p.stdout and "total" in p.stdout
    assert "energy: the metered devices' energy over the window, every process's load" \
        in p.stdout


def test_cli_cpu_estimate_json(tmp_path: Path) -> None:
    import json

    stat = tmp_path / "stat"
    _stat(stat, busy=0, idle=10)
    p = _cli("--meter", "cpu-estimate", "--seconds", "0.3", "--json", "--proc-stat", str(stat))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["meter"] == "cpu-estimate" and out["source"] == "estimated"
    assert out["devices"]["cpu-estimate"]["kind"] == "cpu"


def test_cli_meter_error_exits_2(tmp_path: Path) -> None:
    p = _cli("--meter", "rapl", "--seconds", "0.1", "--rapl-root", str(tmp_path / "none"))
    assert p.returncode == 2
    assert "no RAPL" in p.stderr


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_cli_measures_a_command_and_exits_with_its_code(tmp_path: Path) -> None:
    """`python -m vllm_piep.meter -- CMD`: the command's stdout untouched, the report on stderr,
    one CSV row per run, the JSON record, and the command's exit code."""
    import csv
    import json

    runs, record = tmp_path / "runs.csv", tmp_path / "run.json"
    child = _child("import sys, time; time.sleep(0.4); print('child output'); sys.exit(3)")
    for _ in range(2):
        p = subprocess.run([sys.executable, "-m", "vllm_piep.meter", "--meter", "simulated",
                            "--csv", str(runs), "--json-file", str(record), "--", *child],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == 3, p.stderr
        assert p.stdout == "child output\n"
        assert "SIMULATED" in p.stderr and "(exit 3)" in p.stderr
        # the whole devices' energy over the run, not the command's share
        assert "energy: the metered devices' energy over the command's run, other " \
               "processes' load on them included: not the command's alone" in p.stderr
    rows = list(csv.DictReader(runs.open()))
    assert len(rows) == 2
    for row in rows:
        seconds, joules, watts = float(row["seconds"]), float(row["joules"]), float(row["watts"])
        assert seconds >= 0.4 and joules > 0 and watts == pytest.approx(joules / seconds)
        assert (row["meter"], row["source"], row["exit_code"]) == ("simulated", "simulated", "3")
        assert row["command"].endswith("sys.exit(3)")
    out = json.loads(record.read_text())
    assert out["exit_code"] == 3 and out["command"] == child
    assert out["covers"].startswith("the metered devices' energy over the command's run")
    assert math.fsum(d["joules"] for d in out["devices"].values()) == pytest.approx(out["joules"])
    assert out["start"] < out["end"] and out["start"].endswith("+00:00")


def test_cli_passes_sigint_on_to_the_command_and_still_reports(tmp_path: Path) -> None:
    import signal

    runs = tmp_path / "runs.csv"
    child = _child("import signal, sys, time\n"
                   "signal.signal(signal.SIGINT, lambda *a: sys.exit(7))\n"
                   "print('ready', flush=True)\ntime.sleep(60)\nsys.exit(1)")
    p = subprocess.Popen([sys.executable, "-m", "vllm_piep.meters", "--meter", "simulated",
                          "--csv", str(runs), "--", *child], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        p.send_signal(signal.SIGINT)  # to the meter only: it must reach the command
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 7, err
    assert runs.read_text().splitlines()[1].split(",")[7] == "7"


def test_a_signal_that_comes_while_the_command_starts_reaches_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT sent while the command is being started (the test above sends it as soon as the
    command says it is ready, which a loaded machine can make come before the meter had put
    its handler in place) is passed on once the command runs, not lost nor raised here."""
    import signal

    from vllm_piep.meters import __main__ as cli

    class Command:
        """A command whose start takes long enough for a Ctrl-C to come meanwhile."""

        def __init__(self, argv: list[str]) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            self.signals: list[int] = []

        def poll(self) -> int | None:
            return -self.signals[0] if self.signals else None

        def send_signal(self, signum: int) -> None:
            self.signals.append(signum)

        def wait(self) -> int:
            return -self.signals[0]

    monkeypatch.setattr(cli.subprocess, "Popen", Command)
    meter = SimulatedMeter()
    meter.start()
    before = signal.getsignal(signal.SIGINT)
    assert cli._run_command(meter, ["command"], 0.01, quiet=True) == 128 + signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before  # put back


@pytest.fixture
def cli_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """A fake clock for the CLI run in this process: its waits and its reads of an external log
    (`external:PATH`'s epoch offset included)."""
    from vllm_piep.meters import __main__ as cli
    from vllm_piep.meters import external, factory

    clock = FakeClock()
    install(monkeypatch, clock, cli, external, factory)
    return clock


def test_cli_external_log_energy_is_the_logs_integral(
        tmp_path: Path, cli_clock: FakeClock, capsys: pytest.CaptureFixture[str]) -> None:
    """A wall meter's log covering the window, on this host's monotonic clock: 100 W flat, so
    the window's joules are 100 x its length; a log that ends before the window is refused,
    once the CLI has waited for it to catch up."""
    import json

    from vllm_piep.meters.__main__ import main

    now = cli_clock.monotonic()
    log = tmp_path / "power.csv"
    log.write_text("timestamp,watts\n" + "".join(
        f"{now - 1 + k * 0.1:.6f},100\n" for k in range(40)))  # to now + 2.9 s
    assert main(["--meter", "external", "--external-log", str(log), "--seconds", "0.5",
                 "--interval", "0.1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "measured" and out["seconds"] == 0.5
    assert out["joules"] == pytest.approx(100 * 0.5, rel=1e-9)
    cli_clock.advance(3.0 - 0.5)  # past the log's end
    assert main(["--meter", "external", "--external-log", str(log), "--seconds", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "outside the log" in err and len(err.splitlines()) == 1, err


def test_cli_takes_every_meter_setting_serving_takes(tmp_path: Path, cli_clock: FakeClock,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`--meter external:PATH` reads a wall meter's log stamped in Unix epoch seconds on this
    host's clock, as the serving option does (100 W flat: joules = 100 x the window), and
    `--meter module:callable` builds the meter the callable returns. Every setting name parses,
    and the help names AMD SMI among the meters."""
    import json

    from vllm_piep.meters.__main__ import main, parser
    from vllm_piep.meters.setting import SIMPLE_NAMES

    now = cli_clock.time()
    log = tmp_path / "power.csv"
    log.write_text("timestamp,watts\n" + "".join(
        f"{now - 1 + k * 0.1:.6f},100\n" for k in range(60)))  # to now + 4.9 s
    assert main(["--meter", f"external:{log}", "--seconds", "0.3", "--interval", "0.1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["meter"], out["source"]) == ("external", "measured")
    assert out["seconds"] == 0.3
    assert out["joules"] == pytest.approx(100 * 0.3, rel=1e-9)
    assert main(["--meter", "vllm_piep.meters.simulated:SimulatedMeter", "--seconds", "0.2",
                 "--interval", "0.1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["meter"], out["source"]) == ("simulated", "simulated")
    for name in SIMPLE_NAMES:
        assert parser().parse_args(["--meter", name]).meter == name
    assert "amdsmi" in parser().format_help() and "AMD SMI" in parser().format_help()
