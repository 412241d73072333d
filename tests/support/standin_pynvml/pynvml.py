"""A stand-in `pynvml` module, found first on PYTHONPATH by the GPU check's dry run: one GPU, a
fake_pynvml `NVIDIA A100-SXM4-40GB` drawing `STANDIN_WATTS` (default 80 W) whose energy
counter updates every 40 ms. Its faults, for the tests of the check's verdicts:
`STANDIN_POWER_SKEW` scales what `nvmlDeviceGetPowerUsage` reports against the counter,
`STANDIN_MIG=1` puts the GPU in MIG mode, `STANDIN_FROZEN=1` stops its counter, and
`STANDIN_MISSING=1` makes `nvmlInit` fail as on a machine without the driver. For tests
that compare what an engine split with the counter: once the file `STANDIN_FREEZE` names
exists the counter stops moving, and each value the NVML meter's `read()` gets is appended to
`STANDIN_LOG` (`pid,t_ns,mJ` lines)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from fake_pynvml import FakeGpu, FakeNvml

_env = os.environ.get


class _StandinGpu(FakeGpu):
    frozen_mj: int | None = None

    def counter_mj(self) -> int:
        if _env("STANDIN_FROZEN") == "1":
            return self.start_mj
        freeze = _env("STANDIN_FREEZE")
        if self.frozen_mj is None and freeze and Path(freeze).exists():
            self.frozen_mj = super().counter_mj()
        return self.frozen_mj if self.frozen_mj is not None else super().counter_mj()


class _StandinNvml(FakeNvml):
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        mj = super().nvmlDeviceGetTotalEnergyConsumption(handle)
        log = _env("STANDIN_LOG")
        # The meter's `read()` calls through its `_call`: only those readings are logged.
        if log and sys._getframe(2).f_code.co_name == "read":  # noqa: SLF001
            with open(log, "a") as f:
                f.write(f"{os.getpid()},{time.perf_counter_ns()},{mj}\n")
        return mj

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return round(super().nvmlDeviceGetPowerUsage(handle)
                     * float(_env("STANDIN_POWER_SKEW", "1")))


_NVML = _StandinNvml(
    [_StandinGpu(power_w=float(_env("STANDIN_WATTS", "80")), update_period_s=0.04,
                 memory_bytes=40 * 2**30,
                 mig_uuids=["MIG-11111111-2222-3333-4444-555555555555"]
                 if _env("STANDIN_MIG") == "1" else [])],
    missing=_env("STANDIN_MISSING") == "1")


def __getattr__(name: str) -> Any:
    return getattr(_NVML, name)
