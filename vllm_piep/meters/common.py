"""The meter interface: cumulative joules per device since the meter started, read with a
CLOCK_MONOTONIC timestamp, from a named meter that says whether it measures or estimates.
No vLLM imports; hardware is reached only through the implementations (NVML, RAPL, an external
log, a CPU estimate; a simulator for tests), which is where tests put their stand-ins.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from vllm_piep.clock import now_ns

DeviceKind = Literal["gpu", "cpu", "dram", "system"]
Source = Literal["measured", "estimated", "simulated"]
# A window shorter than its target (its count was timed on calls that may have been
# preempted) starts the windows again with more calls, at most this many times
# (`windows.repeated_sampling`, the campaign's `ReplaySampler`).
SHORT_WINDOW_RETRIES = 3
# The burst that sizes the windows lasts about this fraction of a window.
SIZING_BURST = 1 / 16


def calls_per_window(call: Callable[[], object], sync: Callable[[], object], target_s: float,
                     max_calls: int, agree: Callable[[int], int] = lambda n: n) -> int:
    """The calls a window needs to last `target_s` (a tenth more, so that it is not short by a
    hair), at most `max_calls`: one timed call sizes a burst of calls back to back lasting
    about `SIZING_BURST` of the target, whose mean sizes the window. One call alone, right
    after a warm-up, runs slower than calls back to back (cold caches, the allocator): on the
    campaign's tiny model it made nearly every first window short. `agree` gives the count
    every rank of a group uses (collectives must run as many times on each)."""
    t0 = now_ns()
    call()
    sync()
    one_s = max(now_ns() - t0, 1) / 1e9
    burst = int(agree(min(max_calls, max(1, math.ceil(SIZING_BURST * target_s / one_s)))))
    t0 = now_ns()
    for _ in range(burst):
        call()
    sync()
    per_call_s = max(now_ns() - t0, 1) / 1e9 / burst
    return int(agree(min(max_calls, max(1, math.ceil(1.1 * target_s / per_call_s)))))


def grown_calls(calls: int, length_s: float, target_s: float, max_calls: int) -> int:
    """The calls a window needs to last `target_s`, from one of `calls` calls that lasted
    `length_s` (a fifth more, so that the next one is not short again by a hair), at most
    `max_calls`."""
    return int(min(max_calls, math.ceil(calls * 1.2 * target_s / max(length_s, 1e-9))))


class MeterError(RuntimeError):
    """A meter cannot be used or read; the message says why and what to do."""


class NoMeter(MeterError):
    """Nothing on this machine measures what was asked (no GPU driver, no RAPL): the usual
    case on a CPU, said at info level; any other MeterError is a fault worth a warning."""


class WindowTooShort(MeterError):
    """A window shorter than the meter can resolve (e.g. below NVML's counter update period)."""


# Sources from the most to the least measured: several meters read as one take the last.
SOURCE_ORDER: dict[str, int] = {"measured": 0, "estimated": 1, "simulated": 2}


def least_measured(sources: Iterable[str]) -> Source:
    """The source of several meters' figures read as one: the least measured of theirs."""
    least = max(sources, key=lambda s: SOURCE_ORDER.get(s, len(SOURCE_ORDER)))
    return least  # type: ignore[return-value]


@dataclass(frozen=True)
class Device:
    name: str  # unique within a meter, e.g. "gpu0", "package-0", "dram-0", "wall"
    kind: DeviceKind
    note: str = ""  # what the figure covers, e.g. a whole GPU shared by MIG instances


@dataclass(frozen=True)
class MeterReading:
    """Cumulative joules per device since the meter started, at `t_ns` (CLOCK_MONOTONIC);
    `fitted`: how many of them, cumulative too, are an estimate rather than a reading (a meter
    made of several estimates the part of one that failed; `WorkerMeter`)."""

    t_ns: int
    joules: Mapping[str, float]
    fitted: float = 0.0

    @property
    def total(self) -> float:
        return float(sum(self.joules.values()))


@dataclass(frozen=True)
class WindowEnergy:
    """Energy per device between two readings, and how long the window was."""

    seconds: float
    joules: Mapping[str, float]
    meter: str
    source: Source

    @property
    def total(self) -> float:
        return float(sum(self.joules.values()))

    @property
    def watts(self) -> dict[str, float]:
        return {d: j / self.seconds for d, j in self.joules.items()} if self.seconds > 0 else {}


class Meter(abc.ABC):
    """Start it, read it as often as wanted, stop it. `read()` is cheap and thread-safe."""

    name: str = "meter"
    source: Source = "measured"
    # The shortest window the meter resolves (s): its counter update or sampling period.
    resolution_s: float = 0.0

    @classmethod
    @abc.abstractmethod
    def available(cls) -> bool:
        """Whether this meter can run on this machine (never raises)."""

    @abc.abstractmethod
    def devices(self) -> Sequence[Device]: ...

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def read(self) -> MeterReading: ...

    def stop(self) -> None:  # meters with threads or handles override
        return None

    def __enter__(self) -> Meter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def window(self, start: MeterReading, end: MeterReading,
               allow_short: bool = False) -> WindowEnergy:
        """Energy between two readings. Refuses a window shorter than `resolution_s` unless
        `allow_short` (then the result is an approximation from the counter's last updates)."""
        seconds = (end.t_ns - start.t_ns) / 1e9
        if seconds < 0:
            raise MeterError("window ends before it starts")
        if seconds < self.resolution_s and not allow_short:
            raise WindowTooShort(
                f"{self.name}: a {seconds * 1e3:.1f} ms window is shorter than the meter's "
                f"{self.resolution_s * 1e3:.1f} ms resolution; measure a longer window (repeat "
                "the work, see repeated sampling) or pass allow_short=True for an approximation")
        return WindowEnergy(seconds, {d: end.joules[d] - start.joules.get(d, 0.0)
                                      for d in end.joules}, self.name, self.source)


def refuse_shared_boards(meter: Meter) -> None:
    """MeterError where the started `meter` reads whole GPUs behind MIG instances: the other
    instances' energy would be billed to these requests."""
    shared = [d.name for d in meter.devices() if "MIG instance" in d.note]
    if shared:
        raise MeterError(f"{meter.name} reads only the whole GPU behind MIG instances "
                         f"({', '.join(shared)}), which other instances share: their energy "
                         "would be billed to these requests")


@dataclass
class CompositeMeter(Meter):
    """Several meters read together (e.g. GPU + CPU package + DRAM = system). Device names stay
    unique by prefixing the meter's name where two parts share one."""

    parts: list[Meter] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.parts:
            raise MeterError("a composite meter needs at least one meter")
        self.name = "+".join(p.name for p in self.parts)
        self.source = least_measured(p.source for p in self.parts)
        names = [d.name for p in self.parts for d in p.devices()]
        self._prefix = len(names) != len(set(names))

    @classmethod
    def available(cls) -> bool:
        return True

    @property  # type: ignore[override]
    def resolution_s(self) -> float:  # parts may learn theirs only when started (NVML)
        return max(p.resolution_s for p in self.parts)

    def _key(self, meter: Meter, device: str) -> str:
        return f"{meter.name}:{device}" if self._prefix else device

    def devices(self) -> Sequence[Device]:
        return [Device(self._key(p, d.name), d.kind, d.note)
                for p in self.parts for d in p.devices()]

    def start(self) -> None:
        for p in self.parts:
            p.start()

    def stop(self) -> None:
        for p in self.parts:
            p.stop()

    def read(self) -> MeterReading:
        joules: dict[str, float] = {}
        stamps = []
        fitted = 0.0
        for p in self.parts:
            r = p.read()
            stamps.append(r.t_ns)
            fitted += r.fitted
            joules.update({self._key(p, d): j for d, j in r.joules.items()})
        return MeterReading(max(stamps) if stamps else now_ns(), joules, fitted)
