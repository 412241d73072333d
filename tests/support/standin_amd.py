"""The AMD SMI meter over the stand-in `amdsmi` (standin_amdsmi.py), for a real server: an
MI300X drawing `STANDIN_WATTS` (default 300 W) whose energy accumulator updates every 10 ms.
Each process that opens it logs every reading it returns (`pid,t_ns,joules` lines) to
`STANDIN_LOG`; once the file `STANDIN_FREEZE` exists the accumulator stops moving, so that a
test knows the last reading an engine can have split; once `STANDIN_BACK` exists it reads a
million counts lower than it did, a counter that went back."""

from __future__ import annotations

import os
from pathlib import Path

from reading_log import log_reading
from standin_amdsmi import Board, StandinAmdSmi

from vllm_piep.meters.amdsmi import AmdSmiMeter
from vllm_piep.meters.common import MeterReading


def _exists(variable: str) -> bool:
    path = os.environ.get(variable)
    return bool(path) and Path(path).exists()


class ControlledAmdSmi(StandinAmdSmi):
    frozen: int | None = None

    def amdsmi_get_energy_count(self, handle: int) -> dict:
        info = super().amdsmi_get_energy_count(handle)
        if self.frozen is None and _exists("STANDIN_FREEZE"):
            self.frozen = info["energy_accumulator"]
        if self.frozen is not None:
            info["energy_accumulator"] = self.frozen
        if _exists("STANDIN_BACK"):
            info["energy_accumulator"] -= 1_000_000
        return info


class LoggedAmdSmiMeter(AmdSmiMeter):
    def read(self) -> MeterReading:
        return log_reading(super().read())


def meter() -> AmdSmiMeter:
    board = Board("0000:0c:00.0", float(os.environ.get("STANDIN_WATTS", "300")),
                  start=10_000_000)
    return LoggedAmdSmiMeter(hip_devices=[0], amdsmi=ControlledAmdSmi([board], period_s=0.01),
                             environ={}, detect_s=0.3)
