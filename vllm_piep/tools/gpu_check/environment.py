"""Section 1: the machine, as NVML and torch describe it, and the versions that ran."""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any

from vllm_piep.tools.gpu_check.context import (
    NVML_CLOCK_MEM,
    NVML_CLOCK_SM,
    Context,
    maybe,
    nvml_call,
)

PACKAGES = ("torch", "triton", "transformers", "numpy", "pandas", "onnx", "onnxruntime",
            "nvidia-ml-py", "pydantic", "msgspec", "scikit-learn", "vllm-piep")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_facts(nvml: Any, handle: Any) -> dict[str, Any]:
    """What NVML says about one GPU; None where it cannot say."""
    pci = maybe(nvml.nvmlDeviceGetPciInfo, handle)
    memory = maybe(nvml.nvmlDeviceGetMemoryInfo, handle)
    constraints = nvml_call(nvml, "nvmlDeviceGetPowerManagementLimitConstraints", handle)
    mig = nvml_call(nvml, "nvmlDeviceGetMigMode", handle)

    def mw(value: Any) -> float | None:
        return None if value is None else float(value) / 1000.0

    bus_id = getattr(pci, "busId", None)
    return {
        "name": maybe(nvml.nvmlDeviceGetName, handle),
        "uuid": maybe(nvml.nvmlDeviceGetUUID, handle),
        "pci_bus_id": bus_id.decode() if isinstance(bus_id, bytes) else bus_id,
        "memory_bytes": None if memory is None else int(memory.total),
        "power_limit_w": mw(nvml_call(nvml, "nvmlDeviceGetEnforcedPowerLimit", handle)),
        "default_power_limit_w": mw(nvml_call(nvml, "nvmlDeviceGetPowerManagementDefaultLimit",
                                              handle)),
        "power_limit_range_w": None if constraints is None else [mw(v) for v in constraints],
        "sm_clock_mhz": nvml_call(nvml, "nvmlDeviceGetClockInfo", handle, NVML_CLOCK_SM),
        "mem_clock_mhz": nvml_call(nvml, "nvmlDeviceGetClockInfo", handle, NVML_CLOCK_MEM),
        "max_sm_clock_mhz": nvml_call(nvml, "nvmlDeviceGetMaxClockInfo", handle, NVML_CLOCK_SM),
        "max_mem_clock_mhz": nvml_call(nvml, "nvmlDeviceGetMaxClockInfo", handle,
                                       NVML_CLOCK_MEM),
        "power_w": mw(nvml_call(nvml, "nvmlDeviceGetPowerUsage", handle)),
        "temperature_c": nvml_call(nvml, "nvmlDeviceGetTemperature", handle, 0),
        "pstate": nvml_call(nvml, "nvmlDeviceGetPerformanceState", handle),
        "persistence_mode": nvml_call(nvml, "nvmlDeviceGetPersistenceMode", handle),
        "mig_mode": None if mig is None else int(mig[0]),
        "compute_mode": nvml_call(nvml, "nvmlDeviceGetComputeMode", handle),
        "compute_capability": nvml_call(nvml, "nvmlDeviceGetCudaComputeCapability", handle),
    }


def cuda_version(value: Any) -> str | None:
    """NVML's CUDA driver version (12040) as text (12.4)."""
    return None if value is None else f"{int(value) // 1000}.{int(value) % 1000 // 10}"


def run(ctx: Context) -> None:
    report = ctx.report
    report.figure("versions", versions())
    report.figure("platform", platform.platform())
    torch_facts = ctx.backend.torch_facts()
    report.figure("torch_device0", torch_facts)
    with ctx.nvml() as nvml:
        count = int(nvml.nvmlDeviceGetCount())
        report.figure("driver", nvml_call(nvml, "nvmlSystemGetDriverVersion"))
        report.figure("cuda_driver", cuda_version(
            nvml_call(nvml, "nvmlSystemGetCudaDriverVersion")))
        report.figure("nvml_version", nvml_call(nvml, "nvmlSystemGetNVMLVersion"))
        report.figure("gpu_count", count)
        gpus = [gpu_facts(nvml, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        report.figure("gpus", gpus)
    report.check("NVML sees a GPU and names its driver", {"gpus": count,
                 "driver": report.data["figures"]["driver"]},
                 "at least one GPU and a driver version", count > 0 and
                 bool(report.data["figures"]["driver"]))
    report.check("torch sees the GPU NVML names", torch_facts.get("name"),
                 "torch's device 0 name is one of NVML's GPU names",
                 any(g["name"] == torch_facts.get("name") for g in gpus))
