"""The NVML meter over the stand-in `pynvml` (fake_pynvml.py), for a real server: a GPU drawing
`STANDIN_WATTS` (default 150 W) whose energy counter updates every 20 ms, like a real one.
Each process that opens it logs every reading it returns (`pid,t_ns,joules` lines) to
`STANDIN_LOG`; once the file `STANDIN_FREEZE` exists the counter stops moving, so that a test
knows the last reading an engine can have split; while the file `STANDIN_FAIL` exists, reading
the counter raises NVML's GPU-lost error."""

from __future__ import annotations

import os
from pathlib import Path

from fake_pynvml import FakeGpu, FakeNvml, NVMLError_GpuIsLost
from reading_log import log_reading

from vllm_piep.meters.common import MeterReading
from vllm_piep.meters.nvml import NvmlMeter


class FreezableGpu(FakeGpu):
    frozen_mj: int | None = None

    def counter_mj(self) -> int:
        fail = os.environ.get("STANDIN_FAIL")
        if fail and Path(fail).exists():
            raise NVMLError_GpuIsLost()
        freeze = os.environ.get("STANDIN_FREEZE")
        if self.frozen_mj is None and freeze and Path(freeze).exists():
            self.frozen_mj = super().counter_mj()
        return self.frozen_mj if self.frozen_mj is not None else super().counter_mj()


class LoggedNvmlMeter(NvmlMeter):
    def read(self) -> MeterReading:
        return log_reading(super().read())


def meter() -> NvmlMeter:
    gpu = FreezableGpu(power_w=float(os.environ.get("STANDIN_WATTS", "150")),
                       update_period_s=0.02)
    return LoggedNvmlMeter(indices=[0], nvml=FakeNvml([gpu]), detect_s=0.3)
