"""A stand-in for the `pynvml` module (nvidia-ml-py): the functions the plugin calls, backed by
fake GPUs whose energy counter follows a clock (each GPU's `clock`, integer nanoseconds, default
the real one; a test passes its own fake clock), optionally updated only every
`update_period_s` like a real one, or a value the test sets. GPUs have UUIDs, PCI addresses,
names and the figures a generic profile is built from; a GPU in MIG mode has MIG devices whose
handles are `("mig", gpu, k)` and read no energy of their own (NVML reports it per board)."""

from __future__ import annotations

import time
from collections.abc import Callable
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


class NVMLError_NotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(6, "Not Found")


class NVMLError_InvalidArgument(NVMLError):
    def __init__(self) -> None:
        super().__init__(2, "Invalid Argument")


class PciInfo:
    def __init__(self, domain: int, bus: int, device: int) -> None:
        self.domain, self.bus, self.device = domain, bus, device
        self.busId = f"{domain:08X}:{bus:02X}:{device:02X}.0"


@dataclass
class MemoryInfo:
    total: int
    free: int
    used: int


@dataclass
class FakeGpu:
    power_w: float = 100.0
    has_counter: bool = True
    update_period_s: float | None = None  # counter updated only every this long (None: always)
    manual_mj: int | None = None  # when set, the counter returns exactly this
    start_mj: int = 5_000_000  # "since driver load"
    fail: dict[str, Exception] = field(default_factory=dict)  # function name -> raise this
    clock: Callable[[], int] = time.perf_counter_ns  # what the counter follows
    name: str = "NVIDIA A100-SXM4-40GB"
    uuid: str = ""  # set by FakeNvml from the GPU's position when empty
    pci_bus: int = -1  # likewise
    mig_uuids: list[str] = field(default_factory=list)  # MIG devices: MIG mode is on
    power_limit_mw: int | None = 400_000
    mem_bus_bits: int | None = 5120
    mem_clock_mhz: int | None = 1215
    sm_clock_mhz: int | None = 1410
    cuda_cores: int | None = 6912
    compute_capability: tuple[int, int] | None = (8, 0)
    memory_bytes: int = 40 * 2**30
    processes: list[int] = field(default_factory=list)  # pids NVML lists on it
    sm_clock_now_mhz: int = 1410
    clock_reasons: int = 0  # nvmlClocksEventReason* bits

    def __post_init__(self) -> None:
        self.t0_ns = self.clock()  # the counter reads `start_mj` then

    def counter_mj(self) -> int:
        if self.manual_mj is not None:
            return self.manual_mj
        elapsed_ns = self.clock() - self.t0_ns
        if self.update_period_s:
            elapsed_ns -= elapsed_ns % round(self.update_period_s * 1e9)
        return self.start_mj + int(self.power_w * elapsed_ns / 1e6)


class FakeNvml:
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound

    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, gpus: list[FakeGpu] | None = None, missing: bool = False) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        for i, gpu in enumerate(self.gpus):
            gpu.uuid = gpu.uuid or f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"
            gpu.pci_bus = gpu.pci_bus if gpu.pci_bus >= 0 else 0x17 + i
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
        if not 0 <= i < len(self.gpus):
            raise NVMLError_InvalidArgument()
        return i

    # -- identity and MIG ---------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, handle: object) -> str:
        if isinstance(handle, tuple):
            return self.gpus[handle[1]].mig_uuids[handle[2]]
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: object) -> str:
        if isinstance(handle, tuple):
            return f"{self.gpus[handle[1]].name} MIG 1g.10gb"
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> object:
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return i
            if uuid in gpu.mig_uuids:
                return ("mig", i, gpu.mig_uuids.index(uuid))
        raise NVMLError_NotFound()

    def nvmlDeviceGetPciInfo(self, handle: int) -> PciInfo:
        return PciInfo(0, self._gpu(handle, "nvmlDeviceGetPciInfo").pci_bus, 0)

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        gpu = self._gpu(handle, "nvmlDeviceGetMigMode")
        return [1, 1] if gpu.mig_uuids else [0, 0]

    def nvmlDeviceIsMigDeviceHandle(self, handle: object) -> object:
        import ctypes

        return ctypes.c_uint(1 if isinstance(handle, tuple) else 0)  # as pynvml returns it

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: object) -> int:
        if not isinstance(handle, tuple):
            raise NVMLError_InvalidArgument()
        return handle[1]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int) -> int:
        return len(self._gpu(handle, "nvmlDeviceGetMaxMigDeviceCount").mig_uuids)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, k: int) -> object:
        if not 0 <= k < len(self._gpu(handle, "nvmlDeviceGetMigDeviceHandleByIndex").mig_uuids):
            raise NVMLError_NotFound()
        return ("mig", handle, k)

    # -- what a generic profile is built from ---------------------------------------------------
    def _fact(self, handle: int, fn: str, value: object) -> object:
        self._gpu(handle, fn)
        if value is None:
            raise NVMLError_NotSupported()
        return value

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> object:
        return self._fact(handle, "nvmlDeviceGetEnforcedPowerLimit",
                          self.gpus[handle].power_limit_mw)

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> object:
        return self.nvmlDeviceGetEnforcedPowerLimit(handle)

    def nvmlDeviceGetMemoryBusWidth(self, handle: int) -> object:
        return self._fact(handle, "nvmlDeviceGetMemoryBusWidth", self.gpus[handle].mem_bus_bits)

    def nvmlDeviceGetMaxClockInfo(self, handle: int, clock: int) -> object:
        gpu = self.gpus[handle]
        return self._fact(handle, "nvmlDeviceGetMaxClockInfo",
                          gpu.sm_clock_mhz if clock == 1 else gpu.mem_clock_mhz)

    def nvmlDeviceGetNumGpuCores(self, handle: int) -> object:
        return self._fact(handle, "nvmlDeviceGetNumGpuCores", self.gpus[handle].cuda_cores)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> object:
        return self._fact(handle, "nvmlDeviceGetCudaComputeCapability",
                          self.gpus[handle].compute_capability)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> object:
        return self._fact(handle, "nvmlDeviceGetMaxPcieLinkGeneration", 4)

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> object:
        return self._fact(handle, "nvmlDeviceGetMaxPcieLinkWidth", 16)

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: int) -> object:
        return self.nvmlDeviceGetEnforcedPowerLimit(handle)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        return MemoryInfo(gpu.memory_bytes, gpu.memory_bytes, 0)

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> object:
        gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")
        return gpu.sm_clock_now_mhz if clock in (0, 1) else gpu.mem_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_reasons

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[object]:
        from types import SimpleNamespace

        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=1 << 30) for pid in gpu.processes]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[object]:
        self._gpu(handle, "nvmlDeviceGetGraphicsRunningProcesses")
        return []

    # -- the driver ----------------------------------------------------------------------------
    def nvmlSystemGetDriverVersion(self) -> str:
        return "stand-in 0.0"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 13000

    # -- energy and power ----------------------------------------------------------------------
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        if isinstance(handle, tuple):  # NVML reads no energy of a MIG instance
            raise NVMLError_NotSupported()
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption")
        if not gpu.has_counter:
            raise NVMLError_NotSupported()
        return gpu.counter_mj()

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetPowerUsage")
        return round(gpu.power_w * 1000)
