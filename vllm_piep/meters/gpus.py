"""Which physical GPUs a vLLM instance uses, as NVML handles, and what NVML says about them.

CUDA ordinals are not NVML indices: CUDA numbers the devices `CUDA_VISIBLE_DEVICES` lets it see
(integers, full or abbreviated `GPU-` UUIDs, `MIG-` UUIDs), in its own order, while NVML numbers
every GPU of the host. A GPU is therefore looked up by an order-independent key:

- with the CUDA device's identity (`CudaIdentity`: its UUID, else its PCI address), read in a
  process where CUDA is initialised (a worker), by `nvmlDeviceGetHandleByUUID` or by matching
  `nvmlDeviceGetPciInfo`;
- without it (the API server and the engine core do not initialise CUDA), by the ordinal's
  `CUDA_VISIBLE_DEVICES` entry: a UUID (a prefix is enough, as for CUDA) by matching every GPU's
  and MIG device's UUID, an integer as an NVML index (CUDA's order equals NVML's PCI order
  only with `CUDA_DEVICE_ORDER=PCI_BUS_ID` or identical GPUs: otherwise a warning says so),
  no variable: the ordinal is the NVML index.

A MIG instance has no energy or power reading of its own (NVML reports them for the whole board):
its parent GPU is metered, once however many of its instances the process uses, and labelled as
a whole-GPU figure (`NvmlGpu.mig`).

Everything goes through the `nvml` module passed in (`pynvml`, or a test's stand-in).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_piep.meters.common import MeterError
from vllm_piep.model.devices import GpuFacts
from vllm_piep.once import logger

_MIG_ENABLE = 1  # NVML_DEVICE_MIG_ENABLE


@dataclass(frozen=True)
class CudaIdentity:
    """What CUDA says a device is (`torch.cuda.get_device_properties`)."""

    uuid: str | None  # str(props.uuid): hex without the GPU-/MIG- prefix
    pci: tuple[int, int, int] | None  # (domain, bus, device)

    @classmethod
    def of_torch(cls, ordinal: int) -> CudaIdentity:
        import torch

        props = torch.cuda.get_device_properties(ordinal)
        uuid = getattr(props, "uuid", None)
        pci = tuple(getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
        return cls(str(uuid) if uuid is not None else None,
                   pci if None not in pci else None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class NvmlGpu:
    """One physical GPU of the instance."""

    index: int  # NVML index
    handle: Any
    uuid: str  # GPU-...
    name: str
    ordinals: tuple[int, ...]  # the CUDA ordinals of this process on it
    mig: tuple[str, ...] = ()  # MIG instances used on it: its figures are the whole GPU's

    @property
    def label(self) -> str:
        return f"gpu{self.index}"

    @property
    def note(self) -> str:
        cuda = ",".join(f"cuda:{o}" for o in self.ordinals)
        where = f"{cuda} = {self.uuid}" if cuda else self.uuid
        if self.mig:
            return (f"{where}: whole GPU (MIG instance{'s' if len(self.mig) > 1 else ''} "
                    f"{', '.join(self.mig)} share it; NVML reads no per-instance energy)")
        return where


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _is_mig_handle(nvml: Any, handle: Any) -> bool:
    try:
        return bool(nvml.nvmlDeviceIsMigDeviceHandle(handle))  # a ctypes value: bool() it
    except Exception:  # noqa: BLE001  (NotSupported, FunctionNotFound: not a MIG handle)
        return False


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        return int(nvml.nvmlDeviceGetMigMode(handle)[0]) == _MIG_ENABLE
    except Exception:  # noqa: BLE001  (pre-Ampere GPUs: NotSupported)
        return False


def _mig_devices(nvml: Any, parent: Any) -> list[Any]:
    handles = []
    try:
        count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent))
    except Exception:  # noqa: BLE001
        return []
    for k in range(count):
        try:
            handles.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, k))
        except Exception:  # noqa: BLE001  (NotFound: an empty slot)
            continue
    return handles


class _Host:
    """The host's GPUs as NVML sees them, read once."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        count = int(nvml.nvmlDeviceGetCount())
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in self.handles]
        self._mig: dict[int, list[tuple[str, Any]]] = {}

    def index_of(self, parent: Any) -> int:
        uuid = _text(self.nvml.nvmlDeviceGetUUID(parent))
        return self.uuids.index(uuid)

    def migs(self, index: int) -> list[tuple[str, Any]]:
        if index not in self._mig:
            handle = self.handles[index]
            self._mig[index] = ([(_text(self.nvml.nvmlDeviceGetUUID(m)), m)
                                 for m in _mig_devices(self.nvml, handle)]
                                if _mig_enabled(self.nvml, handle) else [])
        return self._mig[index]

    def by_uuid(self, uuid: str) -> tuple[int, str | None]:
        """(NVML index of the GPU, the MIG device's UUID if `uuid` names one); a prefix of a
        UUID is enough, as for CUDA_VISIBLE_DEVICES."""
        uuid = uuid.strip()
        if uuid.startswith("MIG-GPU-"):  # legacy MIG-GPU-<gpu uuid>/<gi>/<ci>
            gpu, _, rest = uuid[len("MIG-"):].partition("/")
            return self.by_uuid(gpu)[0], uuid
        matches = [i for i, u in enumerate(self.uuids) if u.startswith(uuid)]
        if len(matches) == 1:
            return matches[0], None
        mig = [(i, u) for i in range(len(self.handles)) for u, _ in self.migs(i)
               if u.startswith(uuid)]
        if len(mig) == 1:
            return mig[0][0], mig[0][1]
        raise MeterError(f"nvml: {'no' if not matches and not mig else 'more than one'} GPU "
                         f"or MIG device has a UUID starting with {uuid!r}")

    def by_identity(self, identity: CudaIdentity) -> tuple[int, str | None]:
        if identity.uuid:
            for prefix in ("GPU-", "MIG-"):
                try:
                    handle = self.nvml.nvmlDeviceGetHandleByUUID(prefix + identity.uuid)
                except Exception:  # noqa: BLE001  (NotFound: try the other form)
                    continue
                if _is_mig_handle(self.nvml, handle):
                    parent = self.nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
                    return self.index_of(parent), prefix + identity.uuid
                return self.index_of(handle), None
        if identity.pci is not None:
            for i, handle in enumerate(self.handles):
                pci = self.nvml.nvmlDeviceGetPciInfo(handle)
                if (int(pci.domain), int(pci.bus), int(pci.device)) == identity.pci:
                    return i, None
        raise MeterError(f"nvml: no GPU matches the CUDA device's identity {identity}")


def visible_devices(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """`CUDA_VISIBLE_DEVICES` as entries (None when unset)."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [e.strip() for e in value.split(",") if e.strip()]


def instance_gpus(nvml: Any, ordinals: Sequence[int] | None = None,
                  identities: Mapping[int, CudaIdentity] | None = None,
                  environ: Mapping[str, str] | None = None,
                  nvml_indices: bool = False) -> list[NvmlGpu]:
    """The physical GPUs behind these CUDA ordinals (default: every device CUDA sees), each
    once. `identities` (ordinal -> CudaIdentity) wins over CUDA_VISIBLE_DEVICES;
    `nvml_indices`: the numbers are NVML indices already. NVML must be initialised. Raises
    MeterError naming the ordinal that cannot be found."""
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"} if nvml_indices else (
        os.environ if environ is None else environ)
    host = _Host(nvml)
    entries = visible_devices(env)
    if ordinals is None:
        ordinals = range(len(entries) if entries is not None else len(host.handles))
    identities = identities or {}
    found: dict[int, tuple[list[int], list[str]]] = {}
    integers = False
    for ordinal in ordinals:
        if ordinal in identities:
            index, mig = host.by_identity(identities[ordinal])
        elif entries is None:
            index, mig = int(ordinal), None
        else:
            if not 0 <= ordinal < len(entries):
                raise MeterError(f"nvml: CUDA device {ordinal} is not visible "
                                 f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r})")
            entry = entries[ordinal]
            if entry.startswith(("GPU-", "MIG-")):
                index, mig = host.by_uuid(entry)
            else:
                try:
                    index, mig, integers = int(entry), None, True
                except ValueError as exc:
                    raise MeterError(f"nvml: cannot read CUDA_VISIBLE_DEVICES entry "
                                     f"{entry!r}") from exc
        if not 0 <= index < len(host.handles):
            raise MeterError(f"nvml: CUDA device {ordinal} is NVML GPU {index}, but NVML sees "
                             f"{len(host.handles)} GPU(s)")
        if mig is None and host.migs(index):  # the whole GPU is in MIG mode
            mig = "MIG mode"
        ords, migs = found.setdefault(index, ([], []))
        ords.append(int(ordinal))
        if mig is not None and mig not in migs:
            migs.append(mig)
    gpus = [NvmlGpu(index, host.handles[index], host.uuids[index],
                    _text(nvml.nvmlDeviceGetName(host.handles[index])),
                    () if nvml_indices else tuple(ords), tuple(migs))
            for index, (ords, migs) in found.items()]
    if (integers or entries is None) and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        names = {_text(nvml.nvmlDeviceGetName(h)) for h in host.handles}
        if len(names) > 1:
            logger.warning("vllm_piep: this host has different GPUs (%s) and CUDA numbers them "
                           "fastest first while NVML numbers them by PCI bus: the metered GPUs "
                           "may not be vLLM's. Set CUDA_DEVICE_ORDER=PCI_BUS_ID or list GPU "
                           "UUIDs in CUDA_VISIBLE_DEVICES.", ", ".join(sorted(names)))
    return gpus


def _maybe(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except Exception:  # noqa: BLE001  (NotSupported, FunctionNotFound on older drivers)
        return None


def gpu_facts(nvml: Any, gpu: NvmlGpu) -> GpuFacts:
    """What NVML reports about a GPU that a profile can be built from (None where it cannot
    say)."""
    h = gpu.handle
    limit = _maybe(nvml.nvmlDeviceGetEnforcedPowerLimit, h)
    if limit is None:
        limit = _maybe(nvml.nvmlDeviceGetPowerManagementLimit, h)
    cc = _maybe(nvml.nvmlDeviceGetCudaComputeCapability, h)
    gen = _maybe(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h)
    width = _maybe(nvml.nvmlDeviceGetMaxPcieLinkWidth, h)
    return GpuFacts(
        name=gpu.name,
        power_limit_w=None if limit is None else float(limit) / 1000.0,
        mem_bus_bits=_maybe(nvml.nvmlDeviceGetMemoryBusWidth, h),
        mem_clock_mhz=_maybe(nvml.nvmlDeviceGetMaxClockInfo, h, 2),  # NVML_CLOCK_MEM
        sm_clock_mhz=_maybe(nvml.nvmlDeviceGetMaxClockInfo, h, 1),  # NVML_CLOCK_SM
        cuda_cores=_maybe(nvml.nvmlDeviceGetNumGpuCores, h),
        compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
        pcie=None if gen is None or width is None else (int(gen), int(width)))


def first_instance_gpu_facts(nvml: Any | None = None, ordinal: int = 0) -> GpuFacts:
    """NVML's facts about CUDA device `ordinal` of this process (the engine core's view of
    its first GPU; raises MeterError when NVML cannot tell)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            raise MeterError(f"nvml: cannot import pynvml: {exc}") from exc
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        raise MeterError(f"nvml: NVML is not usable here: {type(exc).__name__}: {exc}") from exc
    try:
        return gpu_facts(nvml, instance_gpus(nvml, [ordinal])[0])
    except MeterError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise MeterError(f"nvml: reading GPU 0: {type(exc).__name__}: {exc}") from exc
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001  (shutting down: nothing to report)
            pass
