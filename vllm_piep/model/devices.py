"""Device profiles of the analytic prior: energy per FLOP, per byte of memory traffic, per byte
over the interconnect, and static power.

The form is the energy roofline (Choi, Bedard, Fowler, Vuduc, "A roofline model of energy",
IPDPS 2013): E = eps_flop * FLOPs + eps_byte * bytes + eps_link * link bytes + P_static * T.
On GPUs its coefficients are fitted to published measurements of vLLM deployments
(`prior_fit.json`, written by `python -m vllm_piep.calibrate fit-prior`): per GPU, the power
drawn while serving that no work explains (P_static), and the power at full FLOP rate and at
full memory bandwidth above it (eps_flop = W_flop / peak_flops, eps_byte = W_byte / bandwidth).
A GPU with no data takes the fitted GPU's three powers as fractions of board power (TDP), times
its own TDP: the datasheet ratio transfer. The link coefficient is not fitted (tensor-parallel
degree moves every term at once in the data): a byte over the link costs a read on the sender,
a write on the receiver and the link itself, eps_link = (TDP - idle) / 2 / link_bw + 2 eps_byte.

Without a fit (CPUs; `fitted=False`, the baseline reports compare against) the coefficients
follow two stated assumptions: at TDP, the power above idle is spent half on arithmetic at peak
rate and half on memory traffic at peak bandwidth. Idle power is not a datasheet figure; each
profile states the value it assumes; measured mode weighs idle time by it.
A calibrated bundle (`python -m vllm_piep.calibrate`) replaces all of this with measurements.
"""


from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from functools import cache
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
class PowerFit:
    """A GPU's fitted powers while serving (`prior_fit.json`): static, and at full FLOP rate
    and full memory bandwidth above static, in watts per GPU."""

    static_watts: float
    flop_watts: float
    byte_watts: float
    source: str


FIT_FILE = Path(__file__).with_name("prior_fit.json")
# GPUs with no data transfer from this fit (ML.ENERGY v3: the current protocol, vLLM 0.11+).
TRANSFER_FROM = "h100-sxm5-80gb"


@cache
def power_fits(path: Path = FIT_FILE) -> dict[str, PowerFit]:
    """The fitted GPUs' powers; {} if the file is absent (the datasheet assumptions serve,
    said once)."""
    if not path.is_file():
        logging.getLogger("vllm_piep").warning(
            "vllm_piep: %s is missing: GPU priors use datasheet assumptions, not the fit to "
            "published measurements", path)
        return {}
    raw = json.loads(path.read_text())
    return {name: PowerFit(**{k: fit[k] for k in ("static_watts", "flop_watts", "byte_watts",
                                                   "source")})
            for name, fit in raw["fits"].items()}


def power_fit(spec: DeviceSpec, fits: dict[str, PowerFit] | None = None) -> PowerFit | None:
    """The spec's own fit, else the reference fit scaled by board power (GPUs only)."""
    fits = power_fits() if fits is None else fits
    if spec.name in fits:
        return fits[spec.name]
    ref = fits.get(TRANSFER_FROM)
    if ref is None or not spec.one_device_per_rank:
        return None
    ref_tdp = GPU_SPECS[TRANSFER_FROM].tdp_watts
    r = spec.tdp_watts / ref_tdp
    return PowerFit(static_watts=ref.static_watts * r, flop_watts=ref.flop_watts * r,
                    byte_watts=ref.byte_watts * r,
                    source=f"transferred from {TRANSFER_FROM} ({ref.source}) by board power "
                           f"{spec.tdp_watts:g} / {ref_tdp:g} W")


@dataclass(frozen=True)
class DeviceProfile:
    """Coefficients the prior uses, for one device and dtype."""

    name: str
    joules_per_flop: float
    joules_per_byte: float
    joules_per_link_byte: float
    static_watts: float  # while serving: charged per step, times its time
    one_device_per_rank: bool
    source: str
    idle_watts: float = 0.0  # with nothing running: measured mode weighs idle time by it

    @classmethod
    def from_spec(cls, spec: DeviceSpec, dtype_bytes: int, fitted: bool = True,
                  fit: PowerFit | None = None) -> DeviceProfile:
        """`fitted`: use the spec's power fit (or its transfer), if any; `fit`: this one."""
        dynamic = spec.tdp_watts - spec.static_watts
        peak = spec.peak_flops_fp32 if dtype_bytes >= 4 else spec.peak_flops_16bit
        fit = fit or (power_fit(spec) if fitted else None)
        if fit is None:
            per_flop, per_byte = dynamic / 2 / peak, dynamic / 2 / spec.mem_bandwidth
            static, source = spec.static_watts, spec.source
        else:
            per_flop, per_byte = fit.flop_watts / peak, fit.byte_watts / spec.mem_bandwidth
            static, source = fit.static_watts, f"{spec.source}; powers {fit.source}"
        return cls(
            name=spec.name,
            joules_per_flop=per_flop,
            joules_per_byte=per_byte,
            joules_per_link_byte=dynamic / 2 / spec.link_bandwidth + 2 * per_byte,
            static_watts=static,
            one_device_per_rank=spec.one_device_per_rank,
            source=source,
            idle_watts=spec.static_watts,
        )


_T = 1e12
_G = 1e9


def _gpu(name: str, tdp: float, static: float, bf16_tflops: float, fp32_tflops: float,
         mem_gb_s: float, link_gb_s: float, source: str) -> DeviceSpec:
    return DeviceSpec(name=name, tdp_watts=tdp, static_watts=static,
                      peak_flops_16bit=bf16_tflops * _T, peak_flops_fp32=fp32_tflops * _T,
                      mem_bandwidth=mem_gb_s * _G, link_bandwidth=link_gb_s * _G,
                      one_device_per_rank=True, source=source)


# Idle power is not a datasheet figure. Where one is given below as "idle (nvidia-smi)", it is
# the P0 floor of idle GPUs (no process, 0 % utilisation) in `nvidia-smi` output pasted in public
# issue threads (NVIDIA/nccl#1264, NVIDIA/TensorRT-LLM#10278, DataDog/datadog-agent#33120 and
# others listed in docs/devices.md); "assumed" values follow the same ratio to board power
# (about 15 %). Tensor figures are dense (NVIDIA prints 2:4-sparse ones; those are halved).
_IDLE_ASSUMED = 0.15

GPU_SPECS: dict[str, DeviceSpec] = {spec.name: spec for spec in [
    # Hopper
    _gpu("h100-sxm5-80gb", 700, 90, 989, 67, 3350, 900,
         "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 700 W, 989 TFLOPS BF16 dense, 67 TFLOPS "
         "FP32, 3.35 TB/s HBM3, NVLink 900 GB/s); idle 90 W assumed"),
    _gpu("h100-pcie-80gb", 350, 48, 756, 51, 2000, 128,
         "NVIDIA H100 Tensor Core GPU datasheet (PCIe: 350 W, 1,513 TFLOPS BF16 sparse = 756 "
         "dense, 51 TFLOPS FP32, 2 TB/s HBM2e; PCIe Gen5 x16 128 GB/s, no NVLink bridge "
         "assumed); idle 46-49 W (nvidia-smi)"),
    _gpu("h100-nvl-94gb", 400, 62, 835.5, 60, 3900, 600,
         "NVIDIA H100 NVL datasheet (400 W, 1,671 TFLOPS BF16 sparse = 835.5 dense, 60 TFLOPS "
         "FP32, 3.9 TB/s HBM3, NVLink bridge 600 GB/s); idle 61-64 W (nvidia-smi)"),
    _gpu("h200-sxm-141gb", 700, 75, 989, 67, 4800, 900,
         "NVIDIA H200 Tensor Core GPU datasheet (SXM: 700 W, 989 TFLOPS BF16 dense, 67 TFLOPS "
         "FP32, 4.8 TB/s HBM3e, NVLink 900 GB/s); idle 73-76 W (nvidia-smi)"),
    _gpu("h200-nvl-141gb", 600, 78, 835.5, 60, 4800, 900,
         "NVIDIA H200 Tensor Core GPU datasheet (NVL: 600 W, 1,671 TFLOPS BF16 sparse = 835.5 "
         "dense, 60 TFLOPS FP32, 4.8 TB/s HBM3e, NVLink bridge 900 GB/s); idle ~78 W "
         "(nvidia-smi)"),
    _gpu("gh200-96gb", 700, 80, 989, 67, 4000, 900,
         "NVIDIA GH200 Grace Hopper Superchip datasheet (GPU: H100 compute, 989 TFLOPS BF16 "
         "dense, 67 TFLOPS FP32, 96 GB HBM3 4 TB/s, NVLink 900 GB/s; module 450-1000 W: the "
         "GPU's 700 W power limit seen by nvidia-smi assumed); idle 73-87 W (nvidia-smi)"),
    _gpu("gh200-144gb", 700, 80, 989, 67, 4900, 900,
         "NVIDIA GH200 Grace Hopper Superchip datasheet (GPU: H100 compute, 989 TFLOPS BF16 "
         "dense, 67 TFLOPS FP32, 144 GB HBM3e 4.9 TB/s, NVLink 900 GB/s; GPU power limit 700 W "
         "assumed); idle as GH200 96GB assumed"),
    # Blackwell
    _gpu("b200", 1000, 165, 2250, 75, 8000, 1800,
         "NVIDIA HGX B200 datasheet (per GPU: 1000 W, 36 PFLOPS BF16 sparse per 8 GPUs = 2,250 "
         "dense, 600 TFLOPS FP32 per 8 GPUs = 75, 8 TB/s HBM3e, NVLink 1.8 TB/s); idle "
         "136-195 W (nvidia-smi)"),
    _gpu("gb200", 1200, 170, 2500, 80, 8000, 1800,
         "NVIDIA GB200 NVL72 datasheet (per GPU: 360 PFLOPS BF16 sparse per 72 GPUs = 2,500 "
         "dense, 576 TB/s per 72 GPUs = 8 TB/s HBM3e, NVLink 1.8 TB/s; FP32 ~80 TFLOPS "
         "uncertain); power limit 1200 W (nvidia-smi); idle 156-181 W (nvidia-smi)"),
    # Ampere
    _gpu("a100-sxm4-40gb", 400, 60, 312, 19.5, 1555, 600,
         "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB: 400 W, 312 TFLOPS BF16 dense, "
         "19.5 TFLOPS FP32, 1,555 GB/s HBM2, NVLink 600 GB/s); idle 60 W assumed"),
    _gpu("a100-sxm4-80gb", 400, 60, 312, 19.5, 2039, 600,
         "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 400 W, 312 TFLOPS BF16 dense, "
         "19.5 TFLOPS FP32, 2,039 GB/s HBM2e, NVLink 600 GB/s); idle 60 W assumed"),
    _gpu("a100-pcie-40gb", 250, 33, 312, 19.5, 1555, 64,
         "NVIDIA A100 Tensor Core GPU datasheet (PCIe 40GB: 250 W, 312 TFLOPS BF16 dense, "
         "19.5 TFLOPS FP32, 1,555 GB/s HBM2, PCIe Gen4 x16 64 GB/s); idle 30-36 W "
         "(nvidia-smi)"),
    _gpu("a100-pcie-80gb", 300, 45, 312, 19.5, 1935, 64,
         "NVIDIA A100 Tensor Core GPU datasheet (PCIe 80GB: 300 W, 312 TFLOPS BF16 dense, "
         "19.5 TFLOPS FP32, 1,935 GB/s HBM2e, PCIe Gen4 x16 64 GB/s); idle 40-49 W "
         "(nvidia-smi)"),
    _gpu("a10g", 300, 10, 70, 35, 600, 64,
         "AWS EC2 G5 documentation (A10G 24 GB GDDR6, 600 GB/s; 300 W power limit seen by "
         "nvidia-smi); no NVIDIA datasheet: ~70 TFLOPS BF16 dense and ~35 TFLOPS FP32 from "
         "Baseten's A10 vs A10G comparison (uncertain); PCIe Gen4 x16 64 GB/s; idle 9-11 W "
         "(nvidia-smi)"),
    _gpu("a10", 150, 15, 125, 31.2, 600, 64,
         "NVIDIA A10 Tensor Core GPU datasheet (150 W, 250 TFLOPS BF16 sparse = 125 dense, "
         "31.2 TFLOPS FP32, 600 GB/s GDDR6, PCIe Gen4 x16 64 GB/s); idle 9-23 W (nvidia-smi)"),
    _gpu("rtx-a6000", 300, 21, 154.8, 38.7, 768, 64,
         "NVIDIA RTX A6000 datasheet (300 W, 309.7 TFLOPS tensor sparse = 154.8 dense, 38.7 "
         "TFLOPS FP32, 768 GB/s GDDR6, PCIe Gen4 x16 64 GB/s); idle 17-25 W (nvidia-smi)"),
    # Ada
    _gpu("l40s", 350, 28, 362, 91.6, 864, 64,
         "NVIDIA L40S datasheet (350 W, 733 TFLOPS BF16 sparse = 362 dense, 91.6 TFLOPS FP32, "
         "864 GB/s GDDR6, PCIe Gen4 x16 64 GB/s); idle 22-34 W (nvidia-smi)"),
    _gpu("l40", 300, 35, 181, 90.5, 864, 64,
         "NVIDIA L40 datasheet (300 W, 362 TFLOPS BF16 sparse = 181 dense, 90.5 TFLOPS FP32, "
         "864 GB/s GDDR6, PCIe Gen4 x16 64 GB/s); idle 35 W (nvidia-smi)"),
    _gpu("l4", 72, 16, 121, 30.3, 300, 64,
         "NVIDIA L4 Tensor Core GPU datasheet (72 W, 121 TFLOPS BF16 dense, 30.3 TFLOPS FP32, "
         "300 GB/s GDDR6, PCIe Gen4 x16 64 GB/s); idle 16 W assumed"),
    _gpu("rtx-4090", 450, 15, 165.2, 82.6, 1008, 64,
         "NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090: 450 W, 165.2 TFLOPS "
         "FP16/BF16 tensor with FP32 accumulate dense, 82.6 TFLOPS FP32, 1,008 GB/s GDDR6X, "
         "PCIe Gen4 x16 64 GB/s); idle 5-24 W (nvidia-smi)"),
    _gpu("rtx-6000-ada", 300, 300 * _IDLE_ASSUMED, 364.2, 91.1, 960, 64,
         "NVIDIA Ada GPU architecture whitepaper and RTX 6000 Ada datasheet (300 W, 364.2 "
         "TFLOPS FP16/BF16 tensor dense, 91.1 TFLOPS FP32, 960 GB/s GDDR6, PCIe Gen4 x16 64 "
         "GB/s); idle 15 % of board power assumed"),
    # Volta and Turing (no BF16: the 16-bit figure is FP16 tensor)
    _gpu("v100-sxm2", 300, 35, 125, 15.7, 900, 300,
         "NVIDIA Tesla V100 datasheet (SXM2: 300 W, 125 TFLOPS FP16 tensor, 15.7 TFLOPS FP32, "
         "900 GB/s HBM2, NVLink 300 GB/s); idle 23-45 W (nvidia-smi)"),
    _gpu("v100-pcie", 250, 25, 112, 14, 900, 32,
         "NVIDIA Tesla V100 datasheet (PCIe: 250 W, 112 TFLOPS FP16 tensor, 14 TFLOPS FP32, "
         "900 GB/s HBM2, PCIe Gen3 x16 32 GB/s); idle 24-27 W (nvidia-smi)"),
    _gpu("t4", 70, 12, 65, 8.1, 320, 32,
         "NVIDIA T4 Tensor Core GPU datasheet (70 W, 65 TFLOPS FP16 tensor, 8.1 TFLOPS FP32, "
         "320 GB/s GDDR6, PCIe Gen3 x16 32 GB/s); idle 9-16 W (nvidia-smi)"),
    # AMD (ROCm reports the device type "cuda")
    _gpu("mi300x", 750, 750 * _IDLE_ASSUMED, 1307.4, 163.4, 5300, 896,
         "AMD Instinct MI300X data sheet (750 W, 1,307.4 TFLOPS BF16 dense, 163.4 TFLOPS FP32 "
         "matrix, 5.3 TB/s HBM3, Infinity Fabric 896 GB/s); idle 15 % of board power assumed"),
    _gpu("mi325x", 1000, 1000 * _IDLE_ASSUMED, 1307.4, 163.4, 6000, 896,
         "AMD Instinct MI325X data sheet (1000 W, 1,307.4 TFLOPS BF16 dense, 163.4 TFLOPS FP32 "
         "matrix, 6 TB/s HBM3E, Infinity Fabric 896 GB/s); idle 15 % of board power assumed"),
]}

# Device names as CUDA and NVML report them (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100 80GB
# PCIe", "Tesla V100-SXM2-32GB", "AMD Instinct MI300X"), matched case-insensitively in order,
# after a MIG suffix (" MIG 1g.10gb") is removed. Older drivers drop the "NVIDIA " prefix.
_GPU_NAME_PATTERNS: list[tuple[str, str]] = [
    (r"GH200.*144G", "gh200-144gb"),
    (r"GH200", "gh200-96gb"),
    (r"GB200", "gb200"),
    (r"\bB200\b", "b200"),
    (r"H200 NVL", "h200-nvl-141gb"),
    (r"H200", "h200-sxm-141gb"),
    (r"H100 NVL", "h100-nvl-94gb"),
    (r"H100.*PCIE", "h100-pcie-80gb"),
    (r"H100", "h100-sxm5-80gb"),  # "HBM3" is the SXM5 board; bare "NVIDIA H100" too
    (r"A100.*80GB.*PCIE|A100-PCIE-80GB", "a100-pcie-80gb"),
    (r"A100.*PCIE", "a100-pcie-40gb"),
    (r"A100.*80GB", "a100-sxm4-80gb"),
    (r"A100", "a100-sxm4-40gb"),
    (r"\bL40S\b", "l40s"),
    (r"\bL40\b", "l40"),
    (r"\bL4\b", "l4"),
    (r"\bA10G\b", "a10g"),
    (r"\bA10\b", "a10"),
    (r"RTX 4090", "rtx-4090"),
    (r"RTX 6000 ADA", "rtx-6000-ada"),
    (r"RTX A6000", "rtx-a6000"),
    (r"V100.*SXM", "v100-sxm2"),
    (r"V100", "v100-pcie"),
    (r"\bT4\b", "t4"),
    (r"MI325X", "mi325x"),
    (r"MI300X", "mi300x"),
]
_MIG_SUFFIX = re.compile(r"\s+MIG\s+\S+\s*$", re.IGNORECASE)


def gpu_profile_key(device_name: str) -> str | None:
    """The profile of a GPU by the name CUDA or NVML reports, None when none fits."""
    name = _MIG_SUFFIX.sub("", device_name.strip())
    for pattern, key in _GPU_NAME_PATTERNS:
        if re.search(pattern, name, re.IGNORECASE):
            return key
    return None


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


def resolve_spec(requested: str, device_type: str, device_name: str | None,
                 cpu_cores: int | None = None) -> DeviceSpec:
    """The spec for `requested` ("auto" or a profile name) on the device vLLM runs on. A GPU
    with no profile raises `UnknownDevice` (the caller builds a generic one from NVML).
    `cpu_cores`: the cores the engine's ranks run on (default: this process's affinity)."""
    requested = requested.strip().lower()
    if requested not in ("", "auto"):
        if requested == "cpu":
            return cpu_spec(cpu_cores)
        if requested in GPU_SPECS:
            return GPU_SPECS[requested]
        known = ", ".join(["auto", "cpu", *GPU_SPECS])
        raise ValueError(f"unknown device profile {requested!r}; known profiles: {known}")
    if device_type == "cpu":
        return cpu_spec(cpu_cores)
    key = gpu_profile_key(device_name or "")
    if key is not None:
        return GPU_SPECS[key]
    raise UnknownDevice(
        f"no device profile for {device_type} device {device_name!r}; set "
        f"--additional-config '{{\"piep\": {{\"device_profile\": ...}}}}' to one of "
        f"{', '.join(['cpu', *GPU_SPECS])} or calibrate a bundle for it")


class UnknownDevice(ValueError):
    """No profile fits the device's name."""


@dataclass(frozen=True)
class GpuFacts:
    """What NVML reports about a GPU (`vllm_piep.meters.gpus.gpu_facts`); None: not reported."""

    name: str
    power_limit_w: float | None = None
    mem_bus_bits: int | None = None
    mem_clock_mhz: float | None = None
    sm_clock_mhz: float | None = None
    cuda_cores: int | None = None
    compute_capability: tuple[int, int] | None = None
    pcie: tuple[int, int] | None = None  # (generation, lanes)


# Per streaming multiprocessor and clock, by compute capability: CUDA cores, and dense 16-bit
# tensor FLOPs (from the profiles above: A100 312 TFLOPS = 108 SMs x 1.41 GHz x 2048; H100 989 =
# 132 x 1.83 x 4096; V100 125 = 80 x 1.53 x 1024; L4 121 = 58 x 2.04 x 1024; GeForce parts run
# FP32 accumulation at half rate: RTX 4090 165 = 128 x 2.52 x 512).
_CORES_PER_SM = {(7, 0): 64, (7, 5): 64, (8, 0): 64}
_TENSOR_FLOPS_PER_SM_CLOCK = {(7, 0): 1024, (7, 5): 1024, (8, 0): 2048, (9, 0): 4096,
                              (10, 0): 8192}
# Data rate per memory clock: NVML's memory clock gives A100 1,555 GB/s = 5120 bits / 8 x
# 1215 MHz x 2 and L4 300 GB/s = 192 / 8 x 6251 x 2.
_TRANSFERS_PER_MEM_CLOCK = 2
_PCIE_GB_S_PER_LANE = {3: 1.97, 4: 3.94, 5: 7.88, 6: 15.75}  # both directions


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def generic_gpu_spec(facts: GpuFacts) -> DeviceSpec:
    """A spec for a GPU no profile fits, from what NVML reports: the power limit as board
    power, memory bandwidth from the bus width and memory clock, FP32 from the CUDA cores and
    SM clock, dense 16-bit tensor throughput from the SM count, SM clock and the per-SM rate
    of its compute capability, the link from its PCIe generation and lanes. What NVML does not
    report is the median of the known GPU profiles, and the source says which figures those
    are."""
    known = list(GPU_SPECS.values())
    assumed: list[str] = []

    def median(field: str, why: str) -> float:
        assumed.append(why)
        return _median([getattr(spec, field) for spec in known])

    tdp = facts.power_limit_w or median("tdp_watts", "board power")
    mem = (facts.mem_bus_bits / 8 * facts.mem_clock_mhz * 1e6 * _TRANSFERS_PER_MEM_CLOCK
           if facts.mem_bus_bits and facts.mem_clock_mhz
           else median("mem_bandwidth", "memory bandwidth"))
    cc = facts.compute_capability
    clock_hz = (facts.sm_clock_mhz or 0) * 1e6
    if facts.cuda_cores and clock_hz:
        fp32 = 2.0 * facts.cuda_cores * clock_hz
        sms = facts.cuda_cores / _CORES_PER_SM.get(cc, 128) if cc else None
    else:
        fp32, sms = median("peak_flops_fp32", "FP32 rate"), None
    if sms and cc:
        per_sm = _TENSOR_FLOPS_PER_SM_CLOCK.get(cc, 1024)
        if "GEFORCE" in facts.name.upper():
            per_sm //= 2
        bf16 = sms * clock_hz * per_sm
    else:
        bf16 = median("peak_flops_16bit", "16-bit tensor rate")
    if facts.pcie:
        link = _PCIE_GB_S_PER_LANE.get(facts.pcie[0], 3.94) * facts.pcie[1] * _G
    else:
        link = median("link_bandwidth", "link bandwidth")
    reported = (f"NVML: power limit {facts.power_limit_w} W, memory bus {facts.mem_bus_bits} "
                f"bits at {facts.mem_clock_mhz} MHz, {facts.cuda_cores} CUDA cores at "
                f"{facts.sm_clock_mhz} MHz, compute capability {cc}, PCIe {facts.pcie}")
    return DeviceSpec(
        name=f"generic/{facts.name}", tdp_watts=tdp, static_watts=tdp * _IDLE_ASSUMED,
        peak_flops_16bit=bf16, peak_flops_fp32=fp32, mem_bandwidth=mem, link_bandwidth=link,
        one_device_per_rank=True,
        source=(f"generic profile for {facts.name!r}, which no datasheet profile fits ("
                f"{reported}); idle {_IDLE_ASSUMED:.0%} of board power assumed"
                + (f"; median of the known profiles for: {', '.join(assumed)}"
                   if assumed else "")))
