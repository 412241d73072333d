"""A stand-in for the `pynvml` module (nvidia-ml-py): the functions NvmlMeter calls, backed by
fake GPUs whose energy counter follows the real clock (optionally updated only every
`update_period_s`, like a real one) or a value the test sets."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class NVMLError(Exception):
    def __init__(self, value: int, msg: str = "") -> None:
        super().__init__(value)
        self.value = value
        self.msg = msg or f"NVML error {value}"

    def __str__(self) -> str:
        return self.msg


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(3, "Not Supported")


class NVMLError_GpuIsLost(NVMLError):
    def __init__(self) -> None:
        super().__init__(15, "GPU is lost")


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(12, "NVML Shared Library Not Found")


@dataclass
class FakeGpu:
    power_w: float = 100.0
    has_counter: bool = True
    update_period_s: float | None = None  # counter updated only every this long (None: always)
    manual_mj: int | None = None  # when set, the counter returns exactly this
    start_mj: int = 5_000_000  # "since driver load"
    fail: dict[str, Exception] = field(default_factory=dict)  # function name -> raise this
    t0: float = field(default_factory=time.perf_counter)

    def counter_mj(self) -> int:
        if self.manual_mj is not None:
            return self.manual_mj
        elapsed = time.perf_counter() - self.t0
        if self.update_period_s:
            elapsed = (elapsed // self.update_period_s) * self.update_period_s
        return self.start_mj + int(self.power_w * elapsed * 1000)


class FakeNvml:
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound

    def __init__(self, gpus: list[FakeGpu] | None = None, missing: bool = False) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.missing = missing
        self.init_count = 0
        self.calls: dict[str, int] = {}

    def _count(self, fn: str) -> None:
        self.calls[fn] = self.calls.get(fn, 0) + 1

    def _gpu(self, handle: int, fn: str) -> FakeGpu:
        self._count(fn)
        if self.init_count <= 0:
            raise NVMLError(1, "Uninitialized")
        gpu = self.gpus[handle]
        if fn in gpu.fail:
            raise gpu.fail[fn]
        return gpu

    def nvmlInit(self) -> None:
        if self.missing:
            raise NVMLError_LibraryNotFound()
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self.init_count -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption")
        if not gpu.has_counter:
            raise NVMLError_NotSupported()
        return gpu.counter_mj()

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetPowerUsage")
        return round(gpu.power_w * 1000)
