"""Device profiles of the analytic prior: idle power, the power that follows how busy the GPUs
are, and energy per FLOP, per byte of memory traffic and per byte over the interconnect.

Per engine step of G GPUs, time T and N requests (docs/prior.md):

    E = P_idle G T                                            (split equally)
      + busy (P_run + P_occ N / (N + G n_half))               (split by work)
      + eps_flop FLOPs + eps_byte bytes + eps_link link bytes  (split by work)
    busy = min(G T, K / eta),  K = FLOPs / peak + bytes / bandwidth + link bytes / link_bw

P_idle is each profile's published idle reading. On GPUs P_run, P_occ, eps_flop = W_flop /
peak_flops and eps_byte = W_byte / bandwidth are fitted to published measurements of vLLM
deployments (`prior_fit.json`, written by `python -m vllm_piep.calibrate fit-prior`), and so
are eta and n_half, to the same model on different GPU counts. A GPU with no data takes the
fitted GPU's busy powers as the same fractions of its own headroom above idle (board power -
idle), its eta and n_half, the same energy per FLOP, and the energy per byte times its memory
type's energy per bit over the fitted GPU's.
The link coefficient is not fitted (tensor-parallel degree moves every term at once in the
data): a byte over the link costs a read on the sender, a write on the receiver and the link
itself, eps_link = (TDP - idle) / 2 / link_bw + 2 eps_byte.

Without a fit (CPUs; `fitted=False`, the baseline reports compare against) there is no busy
power and the coefficients follow two stated assumptions: at TDP, the power above idle is spent
half on arithmetic at peak rate and half on memory traffic at peak bandwidth. Idle power is
not a datasheet figure; each profile gives a published nvidia-smi or amd-smi reading of idle
GPUs and says where it was seen; measured mode weighs idle time by it.
A calibrated bundle (`python -m vllm_piep.calibrate`) replaces all of this with measurements.

The GPU profiles are data: `gpu_profiles.toml`, each figure with its source.
"""


from __future__ import annotations

import json
import logging
import os
import re
import tomllib
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
    peak_flops_fp8: float | None = None  # dense FP8, where the device has it
    memory: str = ""  # the memory's type, a key of `ProfileTable.memory_pj_per_bit`; "": unknown


@dataclass(frozen=True)
class PowerFit:
    """A GPU's fitted powers while serving (`prior_fit.json`), in watts per GPU above its idle
    power: while its kernels run (`run_watts`), more as a step's tokens fill it
    (`occupancy_watts`, half reached at `n_half` tokens per GPU), and the energy per FLOP and
    per byte of memory traffic as watts at the full FLOP rate and the full bandwidth
    (`flop_watts`, `byte_watts`). `eta` and `n_half` are fitted to the GPU-count pairs
    (docs/prior.md)."""

    run_watts: float
    occupancy_watts: float
    flop_watts: float
    byte_watts: float
    source: str
    eta: float
    n_half: float
    transferred_from: str | None = None  # the fitted GPU whose powers these are, scaled


# A step is busy for its work at peak rates divided by eta, at most its whole time: GPUs run
# decode kernels far below peak. A fitted GPU carries its own eta and n_half (`prior_fit.json`,
# fitted to the same model on different GPU counts); these defaults serve profiles without a
# power fit (CPUs, the datasheet baseline).
# N_HALF: tokens per GPU in a step at which the occupancy power is half reached.
ETA = 0.03
N_HALF = 32.0
_FIT_KEYS = ("run_watts", "occupancy_watts", "flop_watts", "byte_watts", "source", "eta",
             "n_half")

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
    fits = {}
    for name, fit in raw["fits"].items():
        missing = [k for k in _FIT_KEYS if k not in fit]
        if missing:
            raise ValueError(f"{path}: the fit of {name!r} lacks {', '.join(missing)} (write it "
                             "with `python -m vllm_piep.calibrate fit-prior`)")
        fits[name] = PowerFit(**{k: fit[k] for k in _FIT_KEYS})
    return fits


def power_fit(spec: DeviceSpec, fits: dict[str, PowerFit] | None = None) -> PowerFit | None:
    """The spec's own fit, else the reference fit transferred (module docstring; GPUs only)."""
    fits = power_fits() if fits is None else fits
    if spec.name in fits:
        return fits[spec.name]
    ref = fits.get(TRANSFER_FROM)
    if ref is None or not spec.one_device_per_rank:
        return None
    ref_spec = GPU_SPECS[TRANSFER_FROM]
    headroom = spec.tdp_watts - spec.static_watts
    ref_headroom = ref_spec.tdp_watts - ref_spec.static_watts
    r = headroom / ref_headroom
    per_bit = PROFILES.memory_pj_per_bit
    memory = (per_bit[spec.memory] / per_bit[ref_spec.memory] if spec.memory in per_bit
              else 1.0)
    memory_note = (f"energy per byte x {memory:.3g} ({spec.memory} over {ref_spec.memory})"
                   if spec.memory in per_bit else "the same energy per byte (memory unknown)")
    return PowerFit(run_watts=ref.run_watts * r, occupancy_watts=ref.occupancy_watts * r,
                    flop_watts=ref.flop_watts * spec.peak_flops_16bit / ref_spec.peak_flops_16bit,
                    byte_watts=ref.byte_watts * memory * spec.mem_bandwidth
                    / ref_spec.mem_bandwidth,
                    eta=ref.eta, n_half=ref.n_half,
                    source=f"transferred from {TRANSFER_FROM} ({ref.source}): busy powers by "
                           f"the headroom above idle, {headroom:g} / {ref_headroom:g} W; the "
                           f"same energy per FLOP; {memory_note}",
                    transferred_from=TRANSFER_FROM)


@dataclass(frozen=True)
class DeviceProfile:
    """Coefficients the prior uses, for one device and dtype."""

    name: str
    joules_per_flop: float
    joules_per_byte: float
    joules_per_link_byte: float
    static_watts: float  # per device, charged per step times its time: its idle power
    one_device_per_rank: bool
    source: str
    idle_watts: float = 0.0  # with nothing running: measured mode weighs idle time by it
    powers_transferred_from: str | None = None  # powers not fitted on this GPU but scaled
    # The load-following part (`PowerFit`; 0 W: none) and the rates that time a step's work.
    run_watts: float = 0.0
    occupancy_watts: float = 0.0
    eta: float = ETA
    n_half: float = N_HALF
    seconds_per_flop: float = 0.0
    seconds_per_byte: float = 0.0
    seconds_per_link_byte: float = 0.0

    @classmethod
    def from_spec(cls, spec: DeviceSpec, dtype_bytes: int, fitted: bool = True,
                  fit: PowerFit | None = None) -> DeviceProfile:
        """`fitted`: use the spec's power fit (or its transfer), if any; `fit`: this one."""
        dynamic = spec.tdp_watts - spec.static_watts
        if dtype_bytes >= 4:
            peak = spec.peak_flops_fp32
        elif dtype_bytes == 1 and spec.peak_flops_fp8:
            peak = spec.peak_flops_fp8
        else:
            peak = spec.peak_flops_16bit
        fit = fit or (power_fit(spec) if fitted else None)
        if fit is None:
            per_flop, per_byte = dynamic / 2 / peak, dynamic / 2 / spec.mem_bandwidth
            source = spec.source
        else:
            per_flop, per_byte = fit.flop_watts / peak, fit.byte_watts / spec.mem_bandwidth
            source = f"{spec.source}; powers {fit.source}"
        return cls(
            name=spec.name,
            joules_per_flop=per_flop,
            joules_per_byte=per_byte,
            joules_per_link_byte=dynamic / 2 / spec.link_bandwidth + 2 * per_byte,
            static_watts=spec.static_watts,
            one_device_per_rank=spec.one_device_per_rank,
            source=source,
            idle_watts=spec.static_watts,
            powers_transferred_from=None if fit is None else fit.transferred_from,
            run_watts=0.0 if fit is None else fit.run_watts,
            occupancy_watts=0.0 if fit is None else fit.occupancy_watts,
            eta=ETA if fit is None else fit.eta,
            n_half=N_HALF if fit is None else fit.n_half,
            seconds_per_flop=1.0 / peak,
            seconds_per_byte=1.0 / spec.mem_bandwidth,
            seconds_per_link_byte=1.0 / spec.link_bandwidth,
        )


_T = 1e12
_G = 1e9
# The datasheet profiles and the names that select them (a data file, one entry per GPU with
# the source of each figure).
PROFILES_FILE = Path(__file__).with_name("gpu_profiles.toml")
# Idle power is not a datasheet figure: each profile gives the floor of idle GPUs (no process,
# 0 % utilisation) in nvidia-smi or amd-smi output published with the GPU named, and its source
# says where (docs/devices.md lists them). Every entry the prior needs is required.
_REQUIRED_KEYS = ("board_watts", "idle_watts", "bf16_tflops", "fp32_tflops", "memory_gb_s",
                  "memory", "link_gb_s", "source")
_PROFILE_KEYS = {*_REQUIRED_KEYS, "fp8_tflops", "compute_units", "engine_mhz", "gfx_target"}


@dataclass(frozen=True)
class ProfileTable:
    """`gpu_profiles.toml`: the profiles, the name patterns in order, and the per-SM and per-CU
    rates the generic profile multiplies out."""

    specs: dict[str, DeviceSpec]
    patterns: list[tuple[str, str]]
    per_sm_clock: dict[tuple[int, int], dict[str, int]]  # by compute capability
    per_cu_clock: dict[str, dict[str, int]]  # by graphics target ("gfx942")
    raw: dict[str, dict]  # each profile's entries as the file gives them
    memory_pj_per_bit: dict[str, float]  # by memory type


def load_profiles(path: Path = PROFILES_FILE) -> ProfileTable:
    """The data file, read strictly: an entry it does not know, or a name pattern for a
    profile it lacks, is refused (ValueError naming the file)."""
    raw = tomllib.loads(path.read_text())
    pj_per_bit = {str(k): float(v) for k, v in raw["memory_pj_per_bit"].items()}
    specs = {}
    for name, p in raw["profiles"].items():
        unknown_keys = sorted(set(p) - _PROFILE_KEYS)
        if unknown_keys:
            raise ValueError(f"{path}: profile {name!r} has unknown entries {unknown_keys}")
        missing = [key for key in _REQUIRED_KEYS if key not in p]
        if missing:
            raise ValueError(f"{path}: profile {name!r} lacks {', '.join(missing)} (every "
                             f"profile gives {', '.join(_REQUIRED_KEYS)})")
        if not 0 < p["idle_watts"] < p["board_watts"]:
            raise ValueError(f"{path}: profile {name!r} has idle_watts {p['idle_watts']}, "
                             f"not between 0 and its board_watts {p['board_watts']}")
        if p["memory"] not in pj_per_bit:
            raise ValueError(f"{path}: profile {name!r} has memory {p['memory']!r}, not one of "
                             f"[memory_pj_per_bit]: {sorted(pj_per_bit)}")
        fp8 = p.get("fp8_tflops")
        specs[name] = DeviceSpec(
            name=name, tdp_watts=float(p["board_watts"]), static_watts=float(p["idle_watts"]),
            peak_flops_16bit=p["bf16_tflops"] * _T, peak_flops_fp32=p["fp32_tflops"] * _T,
            mem_bandwidth=p["memory_gb_s"] * _G, link_bandwidth=p["link_gb_s"] * _G,
            one_device_per_rank=True, source=p["source"],
            peak_flops_fp8=None if fp8 is None else fp8 * _T, memory=str(p["memory"]))
    patterns = [(str(pattern), str(key)) for pattern, key in raw["match"]]
    unknown = sorted({key for _, key in patterns} - specs.keys())
    if unknown:
        raise ValueError(f"{path}: names match profiles it does not define: {unknown}")
    per_sm = {tuple(int(x) for x in cc.split(".")): rates  # type: ignore[misc]
              for cc, rates in raw["per_sm_clock"].items()}
    return ProfileTable(specs, patterns, per_sm, dict(raw["per_cu_clock"]),
                        dict(raw["profiles"]), pj_per_bit)


PROFILES = load_profiles()
GPU_SPECS, _GPU_NAME_PATTERNS = PROFILES.specs, PROFILES.patterns
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
# reports (FMA: 2 FLOPs per lane; two FMA ports assumed). Where RAPL or a CPU estimate
# measures, the meter's figures replace these.
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


def profile_names() -> list[str]:
    """What the `device_profile` option accepts."""
    return ["auto", "cpu", *GPU_SPECS]


def unknown_profile_message(requested: str) -> str:
    import difflib

    close = ([name for name in GPU_SPECS if requested in name]
             or difflib.get_close_matches(requested, list(GPU_SPECS), n=3, cutoff=0.6))
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return (f"unknown device profile {requested!r}{hint}; accepted: "
            f"{', '.join(profile_names())}")


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
        raise ValueError(unknown_profile_message(requested))
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
    """What NVML (`vllm_piep.meters.gpus.gpu_facts`) or AMD SMI
    (`vllm_piep.meters.amdsmi.amd_gpu_facts`) reports about a GPU; None: not reported."""

    name: str
    power_limit_w: float | None = None
    mem_bus_bits: int | None = None
    mem_clock_mhz: float | None = None
    sm_clock_mhz: float | None = None  # NVIDIA: SM clock; AMD: peak engine (GFX) clock
    cuda_cores: int | None = None
    compute_capability: tuple[int, int] | None = None
    pcie: tuple[int, int] | None = None  # (generation, lanes)
    vendor: str = "nvidia"  # "nvidia" (NVML) or "amd" (AMD SMI)
    compute_units: int | None = None  # AMD
    gfx_target: str | None = None  # AMD graphics target, e.g. "gfx942"
    mem_bandwidth_gb_s: float | None = None  # AMD SMI's `vram_max_bandwidth`, where given

    @property
    def tool(self) -> str:
        return "AMD SMI" if self.vendor == "amd" else "NVML"


# Data rate per memory clock: NVML's memory clock gives A100 1,555 GB/s = 5120 bits / 8 x
# 1215 MHz x 2 and L4 300 GB/s = 192 / 8 x 6251 x 2. (AMD SMI's memory clock gives no such
# rule across HBM generations: its bandwidth is read as reported, else the median serves.)
_TRANSFERS_PER_MEM_CLOCK = 2
_PCIE_GB_S_PER_LANE = {3: 1.97, 4: 3.94, 5: 7.88, 6: 15.75}  # both directions


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# A profile's source names where its idle reading was seen: "idle 83-88 W (nvidia-smi)".
_IDLE_READING = re.compile(r"idle [^;:]*\((nvidia-smi|amd-smi|rocm-smi)")


def read_idle_share() -> float:
    """The median ratio of idle to board power over the profiles whose idle power is a
    published reading (a profile without one gives board power times this, and says so)."""
    return _median([spec.static_watts / spec.tdp_watts for spec in GPU_SPECS.values()
                    if _IDLE_READING.search(spec.source)])


def generic_gpu_spec(facts: GpuFacts) -> DeviceSpec:
    """A spec for a GPU no profile fits, from what NVML or AMD SMI reports: the power limit as
    board power; memory bandwidth from the bus width and memory clock (NVIDIA) or as AMD SMI
    reports it; FP32 from the CUDA cores and SM clock (NVIDIA) or the compute units, engine
    clock and per-CU rate of the graphics target (AMD); dense 16-bit tensor/matrix throughput
    from the SM or CU count, clock and per-SM/CU rate of its compute capability or graphics
    target; the link from its PCIe generation and lanes. What the tool does not report is the
    median of the known GPU profiles, and the source says which figures those are."""
    known = list(GPU_SPECS.values())
    assumed: list[str] = []

    def median(field: str, why: str) -> float:
        assumed.append(why)
        return _median([getattr(spec, field) for spec in known])

    tdp = facts.power_limit_w or median("tdp_watts", "board power")
    clock_hz = (facts.sm_clock_mhz or 0) * 1e6
    if facts.vendor == "amd":
        mem = (facts.mem_bandwidth_gb_s * _G if facts.mem_bandwidth_gb_s
               else median("mem_bandwidth", "memory bandwidth"))
        rates = PROFILES.per_cu_clock.get((facts.gfx_target or "").split(":")[0])
        units = facts.compute_units or 0
        fp32 = (units * clock_hz * rates["fp32"] if rates and units and clock_hz
                else median("peak_flops_fp32", "FP32 rate"))
        bf16 = (units * clock_hz * rates["matrix_16bit"] if rates and units and clock_hz
                else median("peak_flops_16bit", "16-bit matrix rate"))
        reported = (f"AMD SMI: power cap {facts.power_limit_w} W, {facts.compute_units} "
                    f"compute units at {facts.sm_clock_mhz} MHz, {facts.gfx_target}, memory "
                    f"bandwidth {facts.mem_bandwidth_gb_s} GB/s, PCIe {facts.pcie}")
    else:
        mem = (facts.mem_bus_bits / 8 * facts.mem_clock_mhz * 1e6 * _TRANSFERS_PER_MEM_CLOCK
               if facts.mem_bus_bits and facts.mem_clock_mhz
               else median("mem_bandwidth", "memory bandwidth"))
        cc = facts.compute_capability
        sm_rates = PROFILES.per_sm_clock.get(cc, {}) if cc else {}
        if facts.cuda_cores and clock_hz:
            fp32 = 2.0 * facts.cuda_cores * clock_hz
            sms = facts.cuda_cores / sm_rates.get("cuda_cores", 128) if cc else None
        else:
            fp32, sms = median("peak_flops_fp32", "FP32 rate"), None
        if sms and cc:
            per_sm = sm_rates.get("tensor_16bit", 1024)
            if "GEFORCE" in facts.name.upper():
                per_sm //= 2
            bf16 = sms * clock_hz * per_sm
        else:
            bf16 = median("peak_flops_16bit", "16-bit tensor rate")
        reported = (f"NVML: power limit {facts.power_limit_w} W, memory bus "
                    f"{facts.mem_bus_bits} bits at {facts.mem_clock_mhz} MHz, "
                    f"{facts.cuda_cores} CUDA cores at {facts.sm_clock_mhz} MHz, compute "
                    f"capability {cc}, PCIe {facts.pcie}")
    if facts.pcie:
        link = _PCIE_GB_S_PER_LANE.get(facts.pcie[0], 3.94) * facts.pcie[1] * _G
    else:
        link = median("link_bandwidth", "link bandwidth")
    idle_share = read_idle_share()
    return DeviceSpec(
        name=f"generic/{facts.name}", tdp_watts=tdp, static_watts=tdp * idle_share,
        peak_flops_16bit=bf16, peak_flops_fp32=fp32, mem_bandwidth=mem, link_bandwidth=link,
        one_device_per_rank=True,
        source=(f"generic profile for {facts.name!r}, which no datasheet profile fits ("
                f"{reported}); idle {idle_share:.1%} of board power, the median idle "
                f"share of the profiles with published readings"
                + (f"; median of the known profiles for: {', '.join(assumed)}"
                   if assumed else "")))
