"""The readings a stand-in meter returns inside a real server's processes, appended to
`STANDIN_LOG` as `pid,t_ns,joules` lines (read back by `servers.engine_readings`)."""

from __future__ import annotations

import os

from vllm_piep.meters.common import MeterReading


def log_reading(reading: MeterReading) -> MeterReading:
    log = os.environ.get("STANDIN_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()},{reading.t_ns},{reading.total!r}\n")
    return reading
