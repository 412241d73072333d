"""The meter of `raising_meter.raising_read` (every read raises), which also logs each read
before it raises: one line, the reading process's id, appended to the file `RAISING_LOG` names.
A test then waits for a number of failed reads, not for a time."""

from __future__ import annotations

import os

from raising_meter import ReadRaisingMeter

from vllm_piep.meters.common import Meter, MeterReading


class LoggedReadRaisingMeter(ReadRaisingMeter):
    def read(self) -> MeterReading:
        with open(os.environ["RAISING_LOG"], "a") as log:
            log.write(f"{os.getpid()}\n")
        return super().read()


def raising_read() -> Meter:
    return LoggedReadRaisingMeter()
