"""Meter readings on disk, next to the span files of a campaign: `meter.jsonl`.

Span files only hold times; the energy of a span's window comes afterwards from the meter's
cumulative readings (`windows.span_energy`). So the campaign logs readings as it goes, and the
span dataset reads them back. Schema `piep.meter/1`, one JSON object per line:

- line 1, the header: `schema`, `meter` (the meter's name), `source` (measured, estimated or
  simulated: an estimate stays labelled), `resolution_s` (the shortest window it resolves),
  `devices` (`[{"name", "kind"}]`), `clock` (`monotonic`: CLOCK_MONOTONIC, as span timestamps),
  plus any extra keys the writer was given (host, boot_id...);
- then one reading per line: `{"t_ns": int, "joules": {device: cumulative joules}}`.

Each line is written whole and flushed, so a crash leaves at most one partial last line, which
the reader skips. A malformed line anywhere else is an error naming file and line.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, get_args

from vllm_piep.meters.common import Device, DeviceKind, Meter, MeterError, MeterReading, Source

SCHEMA = "piep.meter/1"
CLOCK = "monotonic"


class MeterLogError(MeterError, ValueError):
    """A meter log that cannot be read; the message names file and line."""


@dataclass(frozen=True)
class MeterLogHeader:
    meter: str
    source: Source
    resolution_s: float
    devices: tuple[Device, ...]
    clock: str = CLOCK
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "schema": SCHEMA, "meter": self.meter, "source": self.source,
                "resolution_s": self.resolution_s,
                "devices": [{"name": d.name, "kind": d.kind} for d in self.devices],
                "clock": self.clock}


class LoggedMeter(Meter):
    """A meter replayed from its log: what `span_energy` needs (name, source, resolution,
    devices) without the hardware, which is gone by the time the dataset is built."""

    def __init__(self, header: MeterLogHeader, readings: Sequence[MeterReading] = ()):
        self.name = header.meter
        self.source = header.source
        self.resolution_s = header.resolution_s
        self._devices = list(header.devices)
        self._readings = list(readings)

    @classmethod
    def available(cls) -> bool:
        return True

    def devices(self) -> Sequence[Device]:
        return self._devices

    def start(self) -> None:
        return None

    def read(self) -> MeterReading:
        if not self._readings:
            raise MeterError(f"{self.name}: the log holds no readings")
        return self._readings[-1]


class MeterLogWriter:
    """`with MeterLogWriter(path, meter) as log: log.append(meter.read())`. Create it after
    `meter.start()`: some meters (NVML) learn their resolution only when started."""

    def __init__(self, path: str | os.PathLike[str], meter: Meter,
                 extra: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.header = MeterLogHeader(meter.name, meter.source, float(meter.resolution_s),
                                     tuple(meter.devices()), CLOCK, dict(extra or {}))
        self._file: IO[str] | None = self.path.open("w", encoding="utf-8")
        self._lock = threading.Lock()
        self.written = 0
        self._write(self.header.to_json())

    def _write(self, obj: Mapping[str, Any]) -> None:
        with self._lock:
            if self._file is None:
                raise MeterLogError(f"{self.path}: the log is closed")
            self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
            self._file.flush()  # whole lines reach the file: a crash cuts at most the last

    def append(self, reading: MeterReading) -> None:
        self._write({"t_ns": int(reading.t_ns),
                     "joules": {d: float(j) for d, j in reading.joules.items()}})
        self.written += 1

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> MeterLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record(meter: Meter, path: str | os.PathLike[str], interval_s: float,
           stop_event: threading.Event, extra: Mapping[str, Any] | None = None) -> int:
    """Logs `meter.read()` every `interval_s` until `stop_event` is set, then one last reading
    so that the log covers everything up to the stop. Meant as a thread's target:
    `threading.Thread(target=record, args=(meter, path, 0.01, stop), daemon=True)`. The meter
    must be started. Returns the number of readings written."""
    with MeterLogWriter(path, meter, extra) as log:
        log.append(meter.read())
        while not stop_event.wait(interval_s):
            log.append(meter.read())
        log.append(meter.read())
        return log.written


def _header(path: Path, obj: Any) -> MeterLogHeader:
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        found = obj.get("schema") if isinstance(obj, dict) else type(obj).__name__
        raise MeterLogError(f"{path}:1: schema {found!r}, expected {SCHEMA!r}")
    if obj.get("source") not in get_args(Source):
        raise MeterLogError(f"{path}:1: source {obj.get('source')!r} is not one of "
                            f"{get_args(Source)}")
    if obj.get("clock", CLOCK) != CLOCK:
        raise MeterLogError(f"{path}:1: clock {obj.get('clock')!r}; span windows need "
                            f"{CLOCK!r} timestamps")
    devices = []
    for d in obj.get("devices", []):
        name, kind = (d, "system") if isinstance(d, str) else (d["name"], d.get("kind", "system"))
        if kind not in get_args(DeviceKind):
            raise MeterLogError(f"{path}:1: device {name!r} of unknown kind {kind!r}")
        devices.append(Device(str(name), kind))
    known = {"schema", "meter", "source", "resolution_s", "devices", "clock"}
    return MeterLogHeader(str(obj["meter"]), obj["source"], float(obj["resolution_s"]),
                          tuple(devices), CLOCK, {k: v for k, v in obj.items() if k not in known})


def _reading(obj: Any) -> MeterReading:
    t_ns, joules = obj["t_ns"], obj["joules"]
    if not isinstance(t_ns, int) or isinstance(t_ns, bool):
        raise ValueError(f"t_ns {t_ns!r} is not an integer")
    if not isinstance(joules, dict) or not all(
            isinstance(j, int | float) and not isinstance(j, bool) for j in joules.values()):
        raise ValueError(f"joules {joules!r} is not a mapping of device to number")
    return MeterReading(t_ns, {str(d): float(j) for d, j in joules.items()})


def read_meter_log(path: str | os.PathLike[str]) -> tuple[MeterLogHeader, list[MeterReading]]:
    """The header and the readings, in file order. A partial last line (a crash mid-write) is
    skipped; any other malformed line, a reading out of time order or with devices other than
    the header's raises `MeterLogError` naming file and line."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    partial = bool(data) and not data.endswith(b"\n")  # lines[-1] may be cut short
    if not partial:
        lines = lines[:-1]  # the empty string after the final newline
    if not lines or not lines[0].strip():
        raise MeterLogError(f"{path}: no header line (empty file?)")
    try:
        header = _header(path, json.loads(lines[0]))
    except MeterLogError:
        raise
    except Exception as exc:
        raise MeterLogError(f"{path}:1: {type(exc).__name__}: {exc}") from exc
    names = {d.name for d in header.devices}
    readings: list[MeterReading] = []
    for number, raw in enumerate(lines[1:], start=2):
        if not raw.strip():
            continue
        last = partial and number == len(lines)
        try:
            reading = _reading(json.loads(raw))
        except Exception as exc:
            if last:  # cut short by a crash
                break
            raise MeterLogError(f"{path}:{number}: {type(exc).__name__}: {exc}") from exc
        if names and set(reading.joules) != names:
            raise MeterLogError(f"{path}:{number}: devices {sorted(reading.joules)}, the header "
                                f"lists {sorted(names)}")
        if readings and reading.t_ns < readings[-1].t_ns:
            raise MeterLogError(f"{path}:{number}: t_ns {reading.t_ns} goes back in time")
        readings.append(reading)
    return header, readings
