"""A CPU power estimate from utilization, for machines without RAPL (VMs, containers).

Model (the same assumptions as the analytic prior's `model.devices.cpu_spec`):

    P(u) = TDP * (s + (1 - s) * u)

with u the busy fraction of all CPUs over the sample interval, from the aggregate `cpu` line of
/proc/stat (busy = user+nice+system+irq+softirq+steal, idle = idle+iowait; guest time is
already inside user), and s = 0.3 the static fraction of TDP. TDP, in order: the `tdp_watts`
argument; a small table of per-socket datasheet TDPs keyed by a substring of the CPU model
(times the number of sockets); else 10 W per logical CPU counted in /proc/stat. It is an
estimate (`source = "estimated"`), good to tens of percent at best.

A background sampler thread reads /proc/stat every `period_s` (default 0.1 s; `resolution_s`
is that period: the kernel's jiffy counters make shorter intervals too coarse to mean much) and
integrates P over time. `read()` returns the integral up to the last sample plus the last
sample's power times the time since then, so it is cheap and smooth between samples.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import Device, Meter, MeterError, MeterReading
from vllm_piep.model.devices import CPU_STATIC_FRACTION, CPU_WATTS_PER_CORE

DEVICE = Device("cpu-estimate", "cpu")

# Per-socket TDP (W) by CPU model substring (as /proc/cpuinfo "model name" spells it), with
# the vendor page each figure comes from. Matched in order; first match wins.
CPU_TDP_TABLE: list[tuple[str, float, str]] = [
    ("EPYC 9654", 360.0, "AMD EPYC 9654 product page: default TDP 360 W"),
    ("EPYC 7763", 280.0, "AMD EPYC 7763 product page: default TDP 280 W"),
    ("EPYC 7742", 225.0, "AMD EPYC 7742 product page: default TDP 225 W"),
    ("Platinum 8480", 350.0, "Intel ARK, Xeon Platinum 8480+: TDP 350 W"),
    ("Platinum 8380", 270.0, "Intel ARK, Xeon Platinum 8380: TDP 270 W"),
]


def read_proc_stat(path: str | Path = "/proc/stat") -> tuple[int, int, int]:
    """(busy, total, cpus) jiffies from the aggregate `cpu` line and the `cpuN` line count."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise MeterError(f"cannot read {path}: {exc}") from exc
    busy = total = None
    cpus = 0
    for line in text.splitlines():
        if line.startswith("cpu "):
            f = [int(x) for x in line.split()[1:]]
            f += [0] * (8 - len(f))
            user, nice, system, idle, iowait, irq, softirq, steal = f[:8]
            idle_all = idle + iowait
            total = user + nice + system + idle + iowait + irq + softirq + steal
            busy = total - idle_all
        elif line.startswith("cpu") and line[3:4].isdigit():
            cpus += 1
    if busy is None or total is None:
        raise MeterError(f"{path} has no aggregate 'cpu' line")
    return busy, total, max(cpus, 1)


def _cpuinfo(path: str | Path) -> tuple[str, int]:
    """(model name, sockets) from /proc/cpuinfo; ("", 1) when unreadable."""
    try:
        text = Path(path).read_text()
    except OSError:
        return "", 1
    model, sockets = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "physical id":
            sockets.add(value.strip())
    return model, max(1, len(sockets))


def resolve_tdp(tdp_watts: float | None = None, cpus: int = 1, cpu_model: str | None = None,
                sockets: int = 1) -> tuple[float, str]:
    """(TDP in W, where it comes from)."""
    if tdp_watts is not None:
        return float(tdp_watts), "given"
    for key, watts, src in CPU_TDP_TABLE:
        if cpu_model and key in cpu_model:
            return watts * sockets, f"{src} x {sockets} socket(s)"
    return (CPU_WATTS_PER_CORE * cpus,
            f"assumed {CPU_WATTS_PER_CORE:g} W per logical CPU x {cpus} (profiles.cpu_spec)")


class CpuEstimateMeter(Meter):
    """Estimated CPU power from /proc/stat utilization (see the module docstring)."""

    name = "cpu-estimate"
    source = "estimated"

    def __init__(self, tdp_watts: float | None = None,
                 static_fraction: float = CPU_STATIC_FRACTION, period_s: float = 0.1,
                 proc_stat: str | Path = "/proc/stat", cpuinfo: str | Path = "/proc/cpuinfo",
                 sampler: bool = True, clock: Callable[[], int] = now_ns) -> None:
        if period_s <= 0:
            raise ValueError("period_s must be positive")
        if not 0.0 <= static_fraction <= 1.0:
            raise ValueError("static_fraction must be in [0, 1]")
        self.proc_stat = Path(proc_stat)
        _, _, cpus = read_proc_stat(self.proc_stat)
        model, sockets = _cpuinfo(cpuinfo)
        self.tdp_watts, self.tdp_source = resolve_tdp(tdp_watts, cpus, model, sockets)
        self.static_fraction = static_fraction
        self.period_s = period_s
        self.resolution_s = period_s
        self._sampler = sampler
        self._clock = clock
        self._lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._prev: tuple[int, int] = (0, 0)
        self._t_prev = 0
        self._joules = 0.0
        self._watts = 0.0

    @classmethod
    def available(cls, proc_stat: str | Path = "/proc/stat") -> bool:
        try:
            read_proc_stat(proc_stat)
        except (MeterError, ValueError):
            return False
        return True

    def power(self, util: float) -> float:
        """Watts at busy fraction `util` (clamped to [0, 1])."""
        u = min(1.0, max(0.0, util))
        return self.tdp_watts * (self.static_fraction + (1.0 - self.static_fraction) * u)

    def devices(self) -> Sequence[Device]:
        return [DEVICE]

    def start(self) -> None:
        busy, total, _ = read_proc_stat(self.proc_stat)
        with self._lock:
            self._prev = (busy, total)
            self._t_prev = self._clock()
            self._joules = 0.0
            self._watts = self.power(0.0)  # until the first sample says otherwise
            self._started = True
        if self._sampler and self._thread is None:
            self._stop_evt.clear()
            self._thread = threading.Thread(target=self._loop, name="piep-cpu-estimate",
                                            daemon=True)
            self._thread.start()

    def sample(self) -> float:
        """Take one sample now: integrate the power over the interval since the previous one.
        Returns the interval's watts. The sampler thread calls this every `period_s`."""
        busy, total, _ = read_proc_stat(self.proc_stat)
        with self._lock:
            if not self._started:
                raise MeterError("cpu-estimate: sample() before start()")
            t = self._clock()
            d_busy, d_total = busy - self._prev[0], total - self._prev[1]
            if d_total > 0:
                self._watts = self.power(d_busy / d_total)
            # no jiffy elapsed: keep the previous power
            self._joules += self._watts * (t - self._t_prev) / 1e9
            self._prev, self._t_prev = (busy, total), t
            return self._watts

    def _loop(self) -> None:
        while not self._stop_evt.wait(self.period_s):
            try:
                self.sample()
            except MeterError:
                pass

    def read(self) -> MeterReading:
        with self._lock:
            if not self._started:
                raise MeterError("cpu-estimate: read() before start()")
            t = self._clock()
            j = self._joules + self._watts * max(0, t - self._t_prev) / 1e9
            return MeterReading(t, {DEVICE.name: j})

    def stop(self) -> None:
        self._stop_evt.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
