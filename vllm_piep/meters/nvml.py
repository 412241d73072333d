"""NVIDIA GPU energy through NVML, modelled on Zeus (ml-energy/zeus, `zeus/device/gpu/nvidia.py`).

Per GPU, the best source available:
- Volta and newer: `nvmlDeviceGetTotalEnergyConsumption` (mJ since the driver loaded); joules since
  `start()` are the counter's difference / 1000.
- Otherwise (NotSupported / function not found): a background thread polls
  `nvmlDeviceGetPowerUsage` (mW) every `poll_interval_s` and integrates by trapezoid.

`start()` measures how often the energy counter actually changes (it is updated every few tens of
ms, not continuously) and sets `resolution_s` to that period, so `window()` refuses windows the
counter cannot resolve. Any NVML error while reading becomes a `MeterError` naming GPU and call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import Device, MeterError, MeterReading
from vllm_piep.meters.gpus import CudaIdentity, NvmlGpu, instance_gpus
from vllm_piep.meters.polling import GpuCounterMeter, counter_period
from vllm_piep.meters.polling import describe as _describe

# NVML return codes meaning "this GPU/driver cannot do that" (NOT_SUPPORTED, FUNCTION_NOT_FOUND).
_UNSUPPORTED_CODES = {3, 13}


def _load_nvml(nvml: Any = None) -> Any:
    if nvml is not None:
        return nvml
    try:
        import pynvml  # nvidia-ml-py
    except Exception as e:  # pragma: no cover - the package is a dependency
        raise MeterError("nvml: cannot import pynvml (pip install nvidia-ml-py): "
                         f"{_describe(e)}") from e
    return pynvml


def _unsupported(nvml: Any, e: BaseException) -> bool:
    cls = getattr(nvml, "NVMLError_NotSupported", None)
    if isinstance(cls, type) and isinstance(e, cls):
        return True
    return getattr(e, "value", None) in _UNSUPPORTED_CODES


class NvmlMeter(GpuCounterMeter):
    """Cumulative joules per GPU (`gpu{i}`, NVML index) since `start()`.

    Which GPUs: `indices` (NVML indices) when given; else the GPUs behind `cuda_devices`
    (CUDA ordinals of this process, default every device CUDA sees here, so
    CUDA_VISIBLE_DEVICES is honoured), mapped to NVML by UUID or PCI address
    (`vllm_piep.meters.gpus`). A GPU used through MIG instances is metered whole, once, and
    its device says so (`Device.note`)."""

    name = tool = "nvml"

    def __init__(self, indices: list[int] | None = None, nvml: Any = None,
                 poll_interval_s: float = 0.02, allow_short_windows: bool = False,
                 detect_s: float = 0.5, detect_poll_s: float = 0.001, *,
                 cuda_devices: Sequence[int] | None = None,
                 identities: dict[int, CudaIdentity] | None = None,
                 environ: dict[str, str] | None = None) -> None:
        self._settings(poll_interval_s, allow_short_windows, detect_s, detect_poll_s)
        self._nvml = _load_nvml(nvml)
        try:
            self._nvml.nvmlInit()
        except Exception as e:
            raise MeterError(f"nvml: NVML is not usable on this machine (no NVIDIA GPU/driver?): "
                             f"nvmlInit failed: {_describe(e)}") from e
        self._initialised = True
        self.gpus: list[NvmlGpu] = self._find_gpus(
            lambda: self._instance_gpus(indices, cuda_devices, identities, environ))
        self.indices = [g.index for g in self.gpus]
        self._handles = {g.index: g.handle for g in self.gpus}
        self._base_mj: dict[int, int] = {}

    def _instance_gpus(self, indices: list[int] | None, cuda_devices: Sequence[int] | None,
                       identities: dict[int, CudaIdentity] | None,
                       environ: dict[str, str] | None) -> list[NvmlGpu]:
        if indices is not None:
            count = int(self._nvml.nvmlDeviceGetCount())
            bad = [i for i in indices if not 0 <= i < count]
            if bad:
                raise MeterError(f"nvml: GPU indices {bad} out of range; NVML sees "
                                 f"{count} GPU(s)")
            gpus = instance_gpus(self._nvml, list(indices), nvml_indices=True)
        else:
            gpus = instance_gpus(self._nvml, cuda_devices, identities, environ)
        if not gpus:
            raise MeterError("nvml: no GPU selected (NVML sees no GPU)")
        return gpus

    # -- helpers ------------------------------------------------------------------------------
    def _call(self, i: int, fn: str, *args: Any, raw: bool = False) -> Any:
        try:
            return getattr(self._nvml, fn)(*args if raw else (self._handles[i], *args))
        except Exception as e:  # any NVML failure becomes a MeterError
            raise MeterError(f"nvml: gpu{i}: {fn} failed: {_describe(e)}") from e

    def _close_library(self) -> None:
        self._nvml.nvmlShutdown()

    @classmethod
    def available(cls) -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                return int(pynvml.nvmlDeviceGetCount()) > 0
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001  (available() must never raise)
            return False

    def devices(self) -> Sequence[Device]:
        return [Device(g.label, "gpu", g.note) for g in self.gpus]

    @property
    def sampled_gpus(self) -> list[int]:
        """GPUs read by power polling (no energy counter)."""
        return list(self._sampled_gpus)

    def other_processes(self, own: set[int]) -> tuple[int, ...] | None:
        """Processes NVML lists on these GPUs (compute and graphics) that are not in `own`; None
        when NVML cannot tell: it lists none of `own` while it lists others (a container's
        processes appear under the host's PIDs), or it cannot list processes at all."""
        listed: set[int] = set()
        answered = False
        for handle in self._handles.values():
            for fn in ("nvmlDeviceGetComputeRunningProcesses",
                       "nvmlDeviceGetGraphicsRunningProcesses"):
                call = getattr(self._nvml, fn, None)
                if call is None:
                    continue
                try:
                    listed |= {int(p.pid) for p in call(handle)}
                    answered = True
                except Exception:  # noqa: BLE001  (NotSupported on some boards: ask the next)
                    continue
        others = listed - own
        if not answered or (others and not listed & own):
            return None
        return tuple(sorted(others))

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._check_startable()
        counters: dict[int, int] = {}
        for i in self.indices:
            try:
                counters[i] = int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handles[i]))
            except Exception as e:
                if not _unsupported(self._nvml, e):
                    raise MeterError(f"nvml: gpu{i}: nvmlDeviceGetTotalEnergyConsumption "
                                     f"failed: {_describe(e)}") from e
        resolution = 0.0
        if counters:
            resolution = counter_period(
                lambda i: int(self._call(i, "nvmlDeviceGetTotalEnergyConsumption")), counters,
                self.detect_s, self.detect_poll_s)[1]
        for i in counters:
            self._base_mj[i] = int(self._call(i, "nvmlDeviceGetTotalEnergyConsumption"))
        self._begin(self.indices, list(counters), resolution)

    def _power_w(self, i: int) -> float:
        return float(self._call(i, "nvmlDeviceGetPowerUsage")) / 1000.0

    def read(self) -> MeterReading:
        self._check_started()
        joules: dict[str, float] = {}
        for i in self._counter_gpus:
            mj = int(self._call(i, "nvmlDeviceGetTotalEnergyConsumption"))
            joules[f"gpu{i}"] = (mj - self._base_mj[i]) / 1000.0
        t = now_ns()
        for i, j in self._polled.joules(t).items():
            joules[f"gpu{i}"] = j
        return MeterReading(t, {f"gpu{i}": joules[f"gpu{i}"] for i in self.indices})
