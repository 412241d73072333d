"""The NVML meter over the stand-in `pynvml` (fake_pynvml.py), built in each worker of a real
server that meters its workers (`meter_scope: worker`): worker rank r's GPU draws the r-th of
`STANDIN_WATTS` (comma-separated watts), its counter updated every 20 ms like a real one. Each
worker logs every reading it returns (`pid,t_ns,joules`, `STANDIN_LOG`). While the file
`STANDIN_FREEZE` exists every counter stands still, and runs on from where it stood once the
file is gone (so a test knows each counter's value whenever the engine can have split it;
every worker's stops at the instant the file was made, however late its process sees it);
while the file `STANDIN_FAIL` exists, rank `STANDIN_FAIL_RANK`'s counter raises NVML's
GPU-lost error."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fake_pynvml import FakeGpu, FakeNvml, NVMLError_GpuIsLost
from standin_nvml import LoggedNvmlMeter

from vllm_piep.meters.nvml import NvmlMeter


def _exists(variable: str) -> bool:
    path = os.environ.get(variable)
    return bool(path) and Path(path).exists()  # type: ignore[arg-type]


class PausableGpu(FakeGpu):
    """A counter that stands still while the freeze file exists: its running time excludes
    the time frozen."""

    frozen_at: int | None = None
    read_at: int = 0  # the instant of the last value read
    paused_ns: int = 0
    rank: int = 0

    def counter_mj(self) -> int:
        if _exists("STANDIN_FAIL") and self.rank == int(os.environ["STANDIN_FAIL_RANK"]):
            raise NVMLError_GpuIsLost()
        now = time.perf_counter_ns()
        if _exists("STANDIN_FREEZE"):
            if self.frozen_at is None:  # from when the file was made, however late seen,
                # but never before a value already read (a counter never goes back)
                made = Path(os.environ["STANDIN_FREEZE"]).stat().st_mtime_ns
                self.frozen_at = max(self.read_at, min(now, now - (time.time_ns() - made)))
        elif self.frozen_at is not None:
            self.paused_ns += now - self.frozen_at
            self.frozen_at = None
        at = self.frozen_at if self.frozen_at is not None else now
        self.read_at = at
        elapsed_ns = at - self.t0_ns - self.paused_ns
        elapsed_ns -= elapsed_ns % round(0.02 * 1e9)
        return self.start_mj + int(self.power_w * elapsed_ns / 1e6)


def meter() -> NvmlMeter:
    rank = int(os.environ["PIEP_WORKER_RANK"])
    watts = [float(w) for w in os.environ["STANDIN_WATTS"].split(",")]
    gpu = PausableGpu(power_w=watts[rank], start_mj=0)
    gpu.rank = rank
    return LoggedNvmlMeter(indices=[0], nvml=FakeNvml([gpu]), detect_s=0.3)
