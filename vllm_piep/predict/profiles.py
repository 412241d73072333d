"""Device profiles of the analytic prior: energy per FLOP, per byte of memory traffic, per byte
over the interconnect, and static power.

The coefficients follow the energy roofline (Choi, Bedard, Fowler, Vuduc, "A roofline model of
energy", IPDPS 2013): E = eps_flop * FLOPs + eps_byte * bytes + P_static * T. They are derived
from public datasheet figures (TDP, peak dense FLOP rate, memory and link bandwidth) under two
stated assumptions, not measurements:
  1. at TDP, the power above static is spent half on arithmetic at peak rate and half on memory
     traffic at peak bandwidth: eps_flop = (TDP - P_static) / 2 / peak_flops, likewise eps_byte;
  2. a byte over the interconnect costs a memory read on the sender and a write on the receiver
     plus the link itself: eps_link = (TDP - P_static) / 2 / link_bw + 2 * eps_byte.
Static (idle) power is not a datasheet figure; each profile states the value it assumes.
A calibrated bundle (`python -m vllm_piep.calibrate`) replaces all of this with measurements.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DeviceSpec:
    """Public figures of one device, with where they come from."""

    name: str
    tdp_watts: float
    static_watts: float
    peak_flops_16bit: float  # dense BF16/FP16
    peak_flops_fp32: float
    mem_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s, per device
    one_device_per_rank: bool  # GPUs: each TP/PP rank is a device; CPU: ranks share the socket
    source: str


@dataclass(frozen=True)
class DeviceProfile:
    """Coefficients the prior uses, derived from a DeviceSpec for one dtype."""

    name: str
    joules_per_flop: float
    joules_per_byte: float
    joules_per_link_byte: float
    static_watts: float
    one_device_per_rank: bool
    source: str

    @classmethod
    def from_spec(cls, spec: DeviceSpec, dtype_bytes: int) -> DeviceProfile:
        dynamic = spec.tdp_watts - spec.static_watts
        peak = spec.peak_flops_fp32 if dtype_bytes >= 4 else spec.peak_flops_16bit
        per_byte = dynamic / 2 / spec.mem_bandwidth
        return cls(
            name=spec.name,
            joules_per_flop=dynamic / 2 / peak,
            joules_per_byte=per_byte,
            joules_per_link_byte=dynamic / 2 / spec.link_bandwidth + 2 * per_byte,
            static_watts=spec.static_watts,
            one_device_per_rank=spec.one_device_per_rank,
            source=spec.source,
        )


_T = 1e12
_G = 1e9

GPU_SPECS: dict[str, DeviceSpec] = {
    "a100-sxm4-40gb": DeviceSpec(
        name="a100-sxm4-40gb", tdp_watts=400, static_watts=60,
        peak_flops_16bit=312 * _T, peak_flops_fp32=19.5 * _T,
        mem_bandwidth=1555 * _G, link_bandwidth=600 * _G, one_device_per_rank=True,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB: 400 W, 312 TFLOPS BF16 dense, "
        "19.5 TFLOPS FP32, 1,555 GB/s HBM2, NVLink 600 GB/s); idle 60 W assumed",
    ),
    "a100-sxm4-80gb": DeviceSpec(
        name="a100-sxm4-80gb", tdp_watts=400, static_watts=60,
        peak_flops_16bit=312 * _T, peak_flops_fp32=19.5 * _T,
        mem_bandwidth=2039 * _G, link_bandwidth=600 * _G, one_device_per_rank=True,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 400 W, 312 TFLOPS BF16 dense, "
        "19.5 TFLOPS FP32, 2,039 GB/s HBM2e, NVLink 600 GB/s); idle 60 W assumed",
    ),
    "h100-sxm5-80gb": DeviceSpec(
        name="h100-sxm5-80gb", tdp_watts=700, static_watts=90,
        peak_flops_16bit=989 * _T, peak_flops_fp32=67 * _T,
        mem_bandwidth=3350 * _G, link_bandwidth=900 * _G, one_device_per_rank=True,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 700 W, 989 TFLOPS BF16 dense, "
        "67 TFLOPS FP32, 3.35 TB/s HBM3, NVLink 900 GB/s); idle 90 W assumed",
    ),
    "l4": DeviceSpec(
        name="l4", tdp_watts=72, static_watts=16,
        peak_flops_16bit=121 * _T, peak_flops_fp32=30.3 * _T,
        mem_bandwidth=300 * _G, link_bandwidth=64 * _G, one_device_per_rank=True,
        source="NVIDIA L4 Tensor Core GPU datasheet (72 W, 121 TFLOPS BF16 dense, 30.3 TFLOPS "
        "FP32, 300 GB/s GDDR6, PCIe Gen4 x16 64 GB/s); idle 16 W assumed",
    ),
}

# Marketing names as CUDA reports them, matched in order.
_GPU_NAME_PATTERNS: list[tuple[str, str]] = [
    (r"H100", "h100-sxm5-80gb"),
    (r"A100.*80", "a100-sxm4-80gb"),
    (r"A100", "a100-sxm4-40gb"),
    (r"\bL4\b", "l4"),
]

# CPU assumptions (no public per-core figure applies to every CPU): per core, 10 W of TDP of
# which 30 % static, and 8 GB/s of DRAM bandwidth; peak FLOPs from the vector units the CPU
# reports (FMA: 2 FLOPs per lane; two FMA ports assumed). Issue #4's meters replace this with
# RAPL or a measured CPU estimate.
CPU_WATTS_PER_CORE = 10.0
CPU_STATIC_FRACTION = 0.3
_CPU_BYTES_PER_S_PER_CORE = 8 * _G


def _read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    info: dict[str, str] = {}
    for line in first.splitlines():
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return info


def cpu_spec(cores: int | None = None, cpuinfo: dict[str, str] | None = None) -> DeviceSpec:
    """A spec for the CPU cores this process may run on, from /proc/cpuinfo and assumptions."""
    info = _read_cpuinfo() if cpuinfo is None else cpuinfo
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = max(1, int(cores or 1))
    flags = set(info.get("flags", "").split())
    if "avx512f" in flags:
        fp32_lanes, isa = 16, "avx512"
    elif "avx2" in flags:
        fp32_lanes, isa = 8, "avx2"
    else:
        fp32_lanes, isa = 4, "sse"
    fma = 2 if ("fma" in flags or "avx512f" in flags) else 1
    flops_per_cycle = fp32_lanes * fma * 2  # two vector ports
    bf16_factor = 2 if ("avx512_bf16" in flags or "amx_bf16" in flags) else 1
    try:
        hz = float(info.get("cpu MHz", "2000")) * 1e6
    except ValueError:
        hz = 2e9
    tdp = CPU_WATTS_PER_CORE * cores
    model = info.get("model name", "unknown CPU")
    return DeviceSpec(
        name=f"cpu-{isa}-{cores}c",
        tdp_watts=tdp,
        static_watts=tdp * CPU_STATIC_FRACTION,
        peak_flops_16bit=cores * hz * flops_per_cycle * bf16_factor,
        peak_flops_fp32=cores * hz * flops_per_cycle,
        mem_bandwidth=cores * _CPU_BYTES_PER_S_PER_CORE,
        link_bandwidth=cores * _CPU_BYTES_PER_S_PER_CORE,  # ranks exchange through shared memory
        one_device_per_rank=False,
        source=(
            f"{model}, {cores} cores at {hz / 1e9:.2f} GHz, {isa} (/proc/cpuinfo); assumed "
            f"{CPU_WATTS_PER_CORE:g} W/core TDP, {CPU_STATIC_FRACTION:.0%} static, "
            f"{_CPU_BYTES_PER_S_PER_CORE / _G:g} GB/s/core DRAM"
        ),
    )


def resolve_spec(requested: str, device_type: str, device_name: str | None) -> DeviceSpec:
    """The spec for `requested` ("auto" or a profile name) on the device vLLM runs on."""
    requested = requested.strip().lower()
    if requested not in ("", "auto"):
        if requested == "cpu":
            return cpu_spec()
        if requested in GPU_SPECS:
            return GPU_SPECS[requested]
        known = ", ".join(["auto", "cpu", *GPU_SPECS])
        raise ValueError(f"unknown device profile {requested!r}; known profiles: {known}")
    if device_type == "cpu":
        return cpu_spec()
    for pattern, key in _GPU_NAME_PATTERNS:
        if device_name and re.search(pattern, device_name):
            return GPU_SPECS[key]
    raise ValueError(
        f"no device profile for {device_type} device {device_name!r}; set "
        f"--additional-config '{{\"piep\": {{\"device_profile\": ...}}}}' to one of "
        f"{', '.join(['cpu', *GPU_SPECS])} or calibrate a bundle for it"
    )
