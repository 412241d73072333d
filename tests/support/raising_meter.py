"""Meters that fail, injected into a server through PIEP_METER=raising_meter:raising_read (or
raising_open) with tests/support on PYTHONPATH, to test the serve-time sampler's boundary."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_piep.meters.common import Device, Meter, MeterError, MeterReading


class ReadRaisingMeter(Meter):
    """Starts fine; every read raises. Counts its reads so a test can see it was retried."""

    name = "raising-read"
    source = "measured"

    def __init__(self) -> None:
        self.reads = 0
        self.stopped = False

    @classmethod
    def available(cls) -> bool:
        return True

    def devices(self) -> Sequence[Device]:
        return [Device("fake-gpu0", "gpu")]

    def start(self) -> None:
        return None

    def read(self) -> MeterReading:
        self.reads += 1
        raise MeterError("injected meter read failure")

    def stop(self) -> None:
        self.stopped = True


class OpenRaisingMeter(ReadRaisingMeter):
    """Fails to start, as NVML does without a driver."""

    name = "raising-open"

    def start(self) -> None:
        raise MeterError("injected meter open failure")


def raising_read() -> Meter:
    return ReadRaisingMeter()


def raising_open() -> Meter:
    return OpenRaisingMeter()
