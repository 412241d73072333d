"""AMD Instinct GPU energy through AMD SMI (`amdsmi`), beside the NVML meter and after Zeus
(ml-energy/zeus, `zeus/device/gpu/amd.py`).

Per GPU, the best source available:
- the energy accumulator, `amdsmi_get_energy_count`: a counter (`energy_accumulator`, named
  `power` before amdsmi 6.2.1) times its `counter_resolution` (µJ). Joules since `start()` are
  the counter's increments; an increment that is negative by more than half a 32-bit counter
  is a wrap of a 32-bit accumulator (older boards), any other decrease a fault
  (`MeterError`: measured mode then settles those steps by its fit, labelled `fitted`).
  `start()` measures how often the counter changes and sets `resolution_s` to that period.
- where the accumulator is not supported (or does not move while the board draws power): the
  socket power (`amdsmi_get_power_info`: `current_socket_power`, else
  `average_socket_power`, W) polled every `poll_interval_s` and integrated by trapezoid; the
  meter is then named `amdsmi-power`, which the records carry.

Which GPUs: the ROCm runtime's visible devices, as HIP numbers them. `ROCR_VISIBLE_DEVICES`
selects physical devices first, `HIP_VISIBLE_DEVICES` (else `CUDA_VISIBLE_DEVICES`, which HIP
honours the same way) then indexes into those; torch's ordinals count what is left. The
devices are amdsmi's processors in the order it lists them (PCI order, as ROCm's; a compute
partition is a device of its own to both). With the
devices' PCI addresses (`AmdIdentity`, from torch in a process where HIP is initialised) the
lookup is by address instead. A device split into compute partitions (MI300X's CPX, DPX...;
amdsmi lists one processor per partition) is metered whole, once, through its first
partition, and labelled so: the accumulator is the device's. An MI250/MI250X module is two
graphics compute dies (GCDs), each its own PCI device and ROCm device; AMD SMI reports the
module's power and energy on the first die and none on the second (as Zeus found), so a second
die that reports no power is metered with its first, as one device, labelled so.

Everything goes through the `amdsmi` module passed in (the real one, or a test's stand-in).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import Device, MeterError, MeterReading, NoMeter
from vllm_piep.meters.polling import GpuCounterMeter, counter_period
from vllm_piep.meters.polling import describe as _describe
from vllm_piep.model.devices import GpuFacts

_NOT_SUPPORTED = 2  # AMDSMI_STATUS_NOT_SUPPORTED
_WRAP_32 = 1 << 32
_DUAL_DIE = "MI250"  # modules whose second die reports no power of its own


def _load_amdsmi(module: Any = None) -> Any:
    if module is not None:
        return module
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints when libamd_smi is missing
            import amdsmi  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or OSError/AttributeError from a ROCm mismatch
        raise NoMeter("amdsmi: cannot import amdsmi (install vllm-piep[amd] on a ROCm host): "
                      f"{type(e).__name__}: {e}") from e
    return amdsmi


def _unsupported(e: BaseException) -> bool:
    code = getattr(e, "get_error_code", None)
    try:
        return callable(code) and int(code()) == _NOT_SUPPORTED
    except Exception:  # noqa: BLE001  (an error object that cannot say: not "unsupported")
        return False


def _pci(bdf: str) -> tuple[int, int, int]:
    """(domain, bus, device) of a `DDDD:BB:DD.F` address; the function (a partition) apart."""
    domain, bus, rest = bdf.strip().lower().split(":")
    return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)


def visible_physical(count: int, environ: Mapping[str, str] | None = None) -> list[int]:
    """The devices (amdsmi's processors, in its order: a partition of a partitioned GPU counts
    as one, as for ROCm) that HIP ordinals 0, 1, ... stand for:
    `ROCR_VISIBLE_DEVICES` first, then `HIP_VISIBLE_DEVICES` (else `CUDA_VISIBLE_DEVICES`)
    indexing into what it left. Integers only (UUID entries need the devices' identities)."""
    env = os.environ if environ is None else environ
    devices = list(range(count))
    for name in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES" if "HIP_VISIBLE_DEVICES" in env
                 else "CUDA_VISIBLE_DEVICES"):
        value = env.get(name)
        if value is None:
            continue
        try:
            picks = [int(v) for v in value.split(",") if v.strip()]
        except ValueError as e:
            raise MeterError(f"amdsmi: {name}={value!r}: only device indices are understood "
                             "here; give the meter the devices' PCI addresses instead") from e
        bad = [p for p in picks if not 0 <= p < len(devices)]
        if bad:
            raise MeterError(f"amdsmi: {name}={value!r} names devices {bad}; "
                             f"{len(devices)} visible")
        devices = [devices[p] for p in picks]
    return devices


@dataclass(frozen=True)
class AmdIdentity:
    """What HIP says a device is (`torch.cuda.get_device_properties` on ROCm)."""

    pci: tuple[int, int, int]  # (domain, bus, device)

    @classmethod
    def of_torch(cls, ordinal: int) -> AmdIdentity:
        import torch

        props = torch.cuda.get_device_properties(ordinal)
        return cls((int(props.pci_domain_id), int(props.pci_bus_id), int(props.pci_device_id)))


@dataclass(frozen=True)
class AmdGpu:
    """One physical AMD GPU of the instance."""

    index: int  # its first processor in amdsmi's list
    handle: Any
    name: str
    partitions: int  # processors amdsmi lists for it (1: not partitioned)
    mode: str  # the compute partition mode (SPX, DPX, CPX...), "" where amdsmi cannot say
    dies: int = 1  # 2: an MI250/MI250X module, its two GCDs metered together

    @property
    def label(self) -> str:
        return f"gpu{self.index}"

    @property
    def note(self) -> str:
        if self.dies > 1:
            return (f"the whole {self.name or 'GPU'} module, both dies (GCDs): AMD SMI reports "
                    "their energy together on the first")
        if self.partitions <= 1:
            return ""
        return (f"the whole {self.name or 'GPU'}, {self.partitions} {self.mode or 'compute'} "
                "partitions: the energy accumulator is the device's")


class AmdSmiMeter(GpuCounterMeter):
    """Cumulative joules per GPU (`gpu{i}`, amdsmi's processor index) since `start()`
    (module docstring)."""

    tool = "amdsmi"

    def __init__(self, hip_devices: Sequence[int] | None = None, amdsmi: Any = None,
                 poll_interval_s: float = 0.02, allow_short_windows: bool = False,
                 detect_s: float = 0.5, detect_poll_s: float = 0.001, *,
                 identities: Mapping[int, AmdIdentity] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self._settings(poll_interval_s, allow_short_windows, detect_s, detect_poll_s)
        self._smi = _load_amdsmi(amdsmi)
        try:
            self._smi.amdsmi_init()
        except Exception as e:
            raise NoMeter(f"amdsmi: AMD SMI is not usable here (no AMD GPU/driver?): "
                          f"amdsmi_init failed: {_describe(e)}") from e
        self._initialised = True
        self.gpus: list[AmdGpu] = self._find_gpus(
            lambda: self._instance_gpus(hip_devices, identities, environ))
        self.indices = [g.index for g in self.gpus]
        self._handles = {g.index: g.handle for g in self.gpus}
        self._last_count: dict[int, int] = {}
        self._joules: dict[int, float] = {}  # counter GPUs: joules since start

    @property
    def name(self) -> str:  # type: ignore[override]
        return "amdsmi-power" if self._sampled_gpus else "amdsmi"

    # -- which GPUs ---------------------------------------------------------------------------
    def _instance_gpus(self, hip_devices: Sequence[int] | None,
                       identities: Mapping[int, AmdIdentity] | None,
                       environ: Mapping[str, str] | None) -> list[AmdGpu]:
        handles = list(self._smi.amdsmi_get_processor_handles())
        if not handles:
            raise NoMeter("amdsmi: AMD SMI lists no GPU")
        pci = [_pci(str(self._smi.amdsmi_get_gpu_device_bdf(h))) for h in handles]
        # Physical devices: processors sharing (domain, bus, device) are partitions of one; an
        # MI250's second die joins its first.
        owner = dict(zip(pci, pci, strict=True))
        dual = set()
        names = [self._name(h) for h in handles]
        for i in range(1, len(handles), 2):
            if _DUAL_DIE in names[i].upper() and _DUAL_DIE in names[i - 1].upper() \
                    and pci[i] != pci[i - 1] and not self._reports_power(handles[i]):
                owner[pci[i]] = pci[i - 1]
                dual.add(pci[i - 1])
        physical: dict[tuple[int, int, int], list[int]] = {}
        for i, address in enumerate(pci):
            physical.setdefault(owner[address], []).append(i)
        if identities:
            ordinals = list(identities) if hip_devices is None else list(hip_devices)
            missing = [o for o in ordinals if o not in identities
                       or identities[o].pci not in owner]
            if missing:
                raise MeterError(f"amdsmi: HIP devices {missing} are not among the GPUs AMD "
                                 "SMI lists")
            chosen = [owner[identities[o].pci] for o in ordinals]
        else:
            visible = visible_physical(len(handles), environ)
            ordinals = list(range(len(visible))) if hip_devices is None else list(hip_devices)
            bad = [o for o in ordinals if not 0 <= o < len(visible)]
            if bad:
                raise MeterError(f"amdsmi: HIP devices {bad} out of range; {len(visible)} "
                                 "visible")
            chosen = [owner[pci[visible[o]]] for o in ordinals]
        gpus = []
        for address in dict.fromkeys(chosen):  # a device once, however many parts used
            first = physical[address][0]
            handle = handles[first]
            dies = 2 if address in dual else 1
            gpus.append(AmdGpu(first, handle, names[first], len(physical[address]) // dies,
                               self._partition_mode(handle), dies))
        return gpus

    def _reports_power(self, handle: Any) -> bool:
        try:
            info = self._smi.amdsmi_get_power_info(handle)
        except Exception:  # noqa: BLE001  (a die that cannot say reports nothing)
            return False
        return any(isinstance(info.get(k), (int, float)) and info[k] > 0
                   for k in ("current_socket_power", "average_socket_power"))

    def _name(self, handle: Any) -> str:
        try:
            return str(self._smi.amdsmi_get_gpu_asic_info(handle).get("market_name", ""))
        except Exception:  # noqa: BLE001  (a name only labels the device)
            return ""

    def _partition_mode(self, handle: Any) -> str:
        call = getattr(self._smi, "amdsmi_get_gpu_compute_partition", None)
        try:
            return str(call(handle)) if call is not None else ""
        except Exception:  # noqa: BLE001  (older boards have no partitions)
            return ""

    def devices(self) -> Sequence[Device]:
        return [Device(g.label, "gpu", g.note) for g in self.gpus]

    @property
    def sampled_gpus(self) -> list[int]:
        """GPUs read by power polling (no working energy accumulator)."""
        return list(self._sampled_gpus)

    # -- readings -----------------------------------------------------------------------------
    def _call(self, i: int, fn: str) -> Any:
        try:
            return getattr(self._smi, fn)(self._handles[i])
        except Exception as e:  # any AMD SMI failure becomes a MeterError
            raise MeterError(f"amdsmi: gpu{i}: {fn} failed: {_describe(e)}") from e

    def _count(self, i: int) -> tuple[int, float]:
        """The accumulator and its resolution in joules per count."""
        info = self._call(i, "amdsmi_get_energy_count")
        count = info.get("energy_accumulator", info.get("power"))
        resolution = info.get("counter_resolution")
        if not isinstance(count, int) or not isinstance(resolution, (int, float)) \
                or resolution <= 0:
            raise MeterError(f"amdsmi: gpu{i}: amdsmi_get_energy_count gave {info!r}")
        return count, float(resolution) / 1e6

    def _power_w(self, i: int) -> float:
        info = self._call(i, "amdsmi_get_power_info")
        for key in ("current_socket_power", "average_socket_power"):
            value = info.get(key)
            if isinstance(value, (int, float)):
                return float(value)
        raise MeterError(f"amdsmi: gpu{i}: amdsmi_get_power_info reports no socket power "
                         f"({info!r})")

    def _advance(self, i: int, count: int, resolution_j: float) -> None:
        """The counter's increment since its last reading, in joules (wraps handled)."""
        before = self._last_count[i]
        step = count - before
        if step < 0:
            if before < _WRAP_32 and -step > _WRAP_32 // 2:
                step += _WRAP_32  # a 32-bit accumulator wrapped
            else:
                raise MeterError(f"amdsmi: gpu{i}: the energy counter went back from {before} "
                                 f"to {count}")
        self._last_count[i] = count
        self._joules[i] += step * resolution_j

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._check_startable()
        first: dict[int, int] = {}
        for i in self.indices:
            try:
                first[i] = self._count(i)[0]
            except MeterError as e:
                if not _unsupported(e.__cause__ or e):
                    raise
        resolution = 0.0
        if first:
            moving, resolution = counter_period(lambda i: self._count(i)[0], first,
                                                self.detect_s, self.detect_poll_s)
            for i in list(first):
                if i not in moving and self._power_w(i) > 0:  # drawing power, counter still
                    del first[i]
        for i in first:
            self._last_count[i] = self._count(i)[0]
            self._joules[i] = 0.0
        self._begin(self.indices, list(first), resolution)

    def read(self) -> MeterReading:
        self._check_started()
        for i in self._counter_gpus:
            self._advance(i, *self._count(i))
        joules = {i: self._joules[i] for i in self._counter_gpus}
        t = now_ns()
        joules.update(self._polled.joules(t))
        return MeterReading(t, {f"gpu{i}": joules[i] for i in self.indices})

    def _close_library(self) -> None:
        self._smi.amdsmi_shut_down()

    @classmethod
    def available(cls) -> bool:
        try:
            smi = _load_amdsmi()
            smi.amdsmi_init()
            try:
                return len(smi.amdsmi_get_processor_handles()) > 0
            finally:
                smi.amdsmi_shut_down()
        except Exception:  # noqa: BLE001  (available() must never raise)
            return False


def _number(value: Any) -> float | None:
    """AMD SMI's figure, None where it gives "N/A" or nothing."""
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def amd_gpu_facts(smi: Any, handle: Any) -> GpuFacts:
    """What AMD SMI reports about a GPU that a generic profile can be built from (None where it
    cannot say): the power cap (µW), compute units, graphics target, peak GFX clock (MHz),
    `vram_max_bandwidth` (GB/s, newer releases) and the PCIe link."""

    def ask(fn: str, *args: Any) -> dict:
        try:
            return dict(getattr(smi, fn)(handle, *args))
        except Exception:  # noqa: BLE001  (older releases, unsupported queries)
            return {}

    asic = ask("amdsmi_get_gpu_asic_info")
    cap = _number(ask("amdsmi_get_power_cap_info").get("power_cap"))
    clk_type = getattr(getattr(smi, "AmdSmiClkType", None), "GFX", None)
    clock = _number(ask("amdsmi_get_clock_info", clk_type).get("max_clk")) \
        if clk_type is not None else None
    vram = ask("amdsmi_get_gpu_vram_info")
    pcie = ask("amdsmi_get_pcie_info").get("pcie_static", {})
    gen, lanes = _number(pcie.get("pcie_interface_version")), _number(pcie.get("max_pcie_width"))
    units = _number(asic.get("num_compute_units"))
    target = asic.get("target_graphics_version")
    bus = _number(vram.get("vram_bit_width"))
    return GpuFacts(
        name=str(asic.get("market_name") or "AMD GPU"), vendor="amd",
        power_limit_w=None if cap is None else cap / 1e6,
        sm_clock_mhz=clock, compute_units=None if units is None else int(units),
        gfx_target=str(target) if target and target != "N/A" else None,
        mem_bus_bits=None if bus is None else int(bus),
        mem_bandwidth_gb_s=_number(vram.get("vram_max_bandwidth")),
        pcie=None if gen is None or lanes is None else (int(gen), int(lanes)))


def first_instance_amd_facts(ordinal: int = 0, amdsmi: Any = None,
                             environ: Mapping[str, str] | None = None) -> GpuFacts:
    """AMD SMI's facts about HIP device `ordinal` of this process (ROCm's visible-device rules;
    raises MeterError when AMD SMI cannot tell)."""
    smi = _load_amdsmi(amdsmi)
    try:
        smi.amdsmi_init()
    except Exception as e:  # noqa: BLE001
        raise MeterError(f"amdsmi: AMD SMI is not usable here: {_describe(e)}") from e
    try:
        handles = list(smi.amdsmi_get_processor_handles())
        visible = visible_physical(len(handles), environ)
        if not 0 <= ordinal < len(visible):
            raise MeterError(f"amdsmi: HIP device {ordinal} out of range; {len(visible)} "
                             "visible")
        return amd_gpu_facts(smi, handles[visible[ordinal]])
    except MeterError:
        raise
    except Exception as e:  # noqa: BLE001
        raise MeterError(f"amdsmi: reading HIP device {ordinal}: {_describe(e)}") from e
    finally:
        with contextlib.suppress(Exception):  # shutting down: nothing to report
            smi.amdsmi_shut_down()
