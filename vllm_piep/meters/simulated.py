"""A deterministic simulated meter, for tests and demos only (never chosen by `auto`).

Each device draws watts(t) = base + amp * sin(2*pi*t / period), t seconds since start(); the
cumulative energy is the closed form

    E(t) = base * t + amp * period / (2*pi) * (1 - cos(2*pi*t / period)),

evaluated at the injected clock, so readings are exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import Device, DeviceKind, Meter, MeterError, MeterReading


@dataclass(frozen=True)
class SimTrace:
    base_watts: float
    amp_watts: float = 0.0
    period_s: float = 1.0
    kind: DeviceKind = "gpu"

    def watts(self, t: float) -> float:
        return self.base_watts + self.amp_watts * math.sin(2 * math.pi * t / self.period_s)

    def joules(self, t: float) -> float:
        w = 2 * math.pi / self.period_s
        return self.base_watts * t + self.amp_watts / w * (1.0 - math.cos(w * t))


DEFAULT_TRACES: dict[str, SimTrace] = {
    "sim-gpu0": SimTrace(150.0, 50.0, 2.0, "gpu"),
    "sim-cpu": SimTrace(40.0, 10.0, 5.0, "cpu"),
}


class SimulatedMeter(Meter):
    name = "simulated"
    source = "simulated"
    resolution_s = 0.0

    def __init__(self, traces: Mapping[str, SimTrace] | None = None,
                 clock: Callable[[], int] = now_ns) -> None:
        self.traces = dict(DEFAULT_TRACES if traces is None else traces)
        if not self.traces:
            raise MeterError("simulated: needs at least one device trace")
        for n, tr in self.traces.items():
            if tr.period_s <= 0:
                raise MeterError(f"simulated: device {n!r} needs a positive period")
        self._clock = clock
        self._t0: int | None = None

    @classmethod
    def available(cls) -> bool:
        return True

    def devices(self) -> Sequence[Device]:
        return [Device(n, tr.kind) for n, tr in self.traces.items()]

    def start(self) -> None:
        self._t0 = self._clock()

    def read(self) -> MeterReading:
        if self._t0 is None:
            raise MeterError("simulated: read() before start()")
        t_ns = self._clock()
        t = (t_ns - self._t0) / 1e9
        return MeterReading(t_ns, {n: tr.joules(t) for n, tr in self.traces.items()})
