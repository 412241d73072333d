"""Pick the best meter this machine offers, or build one by name.

`auto_meter`: NVML (the GPUs only: RAPL reads the whole CPU socket, other processes' work
included, so it joins NVML only when asked for, `nvml+rapl`), else AMD SMI, else RAPL, else the
CPU estimate. Serving with `meter` unset takes only a meter that measures (`factory.py`:
`measuring_only`): never the CPU estimate.
The simulator is never chosen automatically. NVML and the external-log meter live in
modules of their own and are imported lazily, so an import failure there only makes them
unavailable here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_piep.meters.common import CompositeMeter, Meter, MeterError
from vllm_piep.meters.cpu_estimate import CpuEstimateMeter
from vllm_piep.meters.rapl import DEFAULT_ROOT, RaplMeter
from vllm_piep.meters.setting import METER_NAMES
from vllm_piep.meters.simulated import SimulatedMeter


def _nvml_class() -> type[Meter] | None:
    try:
        from vllm_piep.meters.nvml import NvmlMeter  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001  (ImportError or a broken module: NVML unavailable)
        return None
    return NvmlMeter


def _nvml_available() -> bool:
    cls = _nvml_class()
    if cls is None:
        return False
    try:
        return bool(cls.available())
    except Exception:  # noqa: BLE001  (available() must not raise; treat as unavailable)
        return False


def auto_meter(nvml_factory: Callable[[], Meter] | None = None,
               rapl_root: str | Path = DEFAULT_ROOT,
               nvml_available: bool | None = None,
               rapl_kw: dict[str, Any] | None = None,
               cpu_kw: dict[str, Any] | None = None,
               amd_factory: Callable[[], Meter] | None = None,
               amd_available: bool | None = None) -> tuple[Meter, str]:
    """(meter, a sentence saying why it was chosen).

    NVML's GPUs first, then AMD SMI's, then RAPL, then the CPU estimate. `amd_available`
    overrides asking `AmdSmiMeter.available()`; `amd_factory` builds the AMD meter (default
    `AmdSmiMeter()`).
    `nvml_available` overrides asking `NvmlMeter.available()` (tests); `nvml_factory` builds the
    NVML meter (default `NvmlMeter()`); `rapl_kw` / `cpu_kw` go to the RAPL / CPU-estimate
    constructors (e.g. `poll_interval_s`, `proc_stat`)."""
    rapl_kw = dict(rapl_kw or {})
    cpu_kw = dict(cpu_kw or {})
    rapl_why = RaplMeter.why_unavailable(rapl_root)
    rapl: Meter | None = None
    if rapl_why is None:
        try:
            rapl = RaplMeter(rapl_root, **rapl_kw)
        except MeterError as exc:
            rapl_why = str(exc)

    has_nvml = _nvml_available() if nvml_available is None else nvml_available
    nvml_why = "NVML is not available (no NVIDIA GPU/driver, or the NVML meter is missing)"
    if has_nvml:
        try:
            if nvml_factory is None:
                cls = _nvml_class()
                if cls is None:
                    raise MeterError("vllm_piep.meters.nvml cannot be imported")
                nvml: Meter = cls()
            else:
                nvml = nvml_factory()
        except MeterError as exc:
            nvml_why = f"NVML reported available but failed to start: {exc}"
        else:
            gpus = ", ".join(f"{d.name} ({d.note})" if d.note else d.name
                             for d in nvml.devices())
            cpu = ("the CPU socket is not included (`nvml+rapl` adds RAPL, which reads the "
                   "whole socket, other processes included)" if rapl is not None else
                   f"CPU energy is not measured ({rapl_why})")
            return nvml, f"NVML measures the GPUs {gpus}; {cpu}"

    from vllm_piep.meters.amdsmi import AmdSmiMeter

    if AmdSmiMeter.available() if amd_available is None else amd_available:
        try:
            amd = amd_factory() if amd_factory is not None else AmdSmiMeter()
        except MeterError as exc:
            nvml_why += f"; AMD SMI reported GPUs but failed to start: {exc}"
        else:
            gpus = ", ".join(f"{d.name} ({d.note})" if d.note else d.name
                             for d in amd.devices())
            return amd, f"AMD SMI measures the GPUs {gpus}; {nvml_why}"

    if rapl is not None:
        return rapl, f"RAPL measures CPU package and DRAM energy; {nvml_why}"
    cpu = CpuEstimateMeter(**cpu_kw)
    return cpu, (f"neither NVML nor RAPL is usable, so CPU power is estimated from utilization "
                 f"x TDP ({cpu.tdp_watts:g} W, {cpu.tdp_source}); {nvml_why}; RAPL: {rapl_why}")


def make_meter(name: str, **kw: Any) -> Meter:
    """A meter by name (one of METER_NAMES); keyword arguments go to its constructor (for
    `auto`, to `auto_meter`; for `nvml+rapl`, to NVML's, and `rapl_kw` to RAPL's)."""
    key = name.strip().lower()
    if key == "auto":
        return auto_meter(**kw)[0]
    if key == "rapl":
        return RaplMeter(**kw)
    if key in ("cpu-estimate", "cpu"):
        return CpuEstimateMeter(**kw)
    if key in ("simulated", "sim"):
        return SimulatedMeter(**kw)
    if key == "nvml":
        cls = _nvml_class()
        if cls is None:
            raise MeterError("the nvml meter cannot be imported (vllm_piep.meters.nvml)")
        return cls(**kw)
    if key == "amdsmi":
        from vllm_piep.meters.amdsmi import AmdSmiMeter

        return AmdSmiMeter(**kw)
    if key == "nvml+rapl":  # the GPUs and the CPU socket (package and DRAM), summed
        rapl_kw = kw.pop("rapl_kw", None) or {}
        return CompositeMeter(parts=[make_meter("nvml", **kw), RaplMeter(**rapl_kw)])
    if key == "external":
        try:
            from vllm_piep.meters.external import (  # type: ignore[import-not-found]
                ExternalLogMeter,
            )
        except ImportError as exc:
            raise MeterError(f"the external meter cannot be imported: {exc}") from exc
        return ExternalLogMeter(**kw)
    raise MeterError(f"unknown meter {name!r}; valid names: {', '.join(METER_NAMES)}")
