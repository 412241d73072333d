"""A meter from its setting as users write it (`meter` option, PIEP_METER), for any process:
the API server's /metrics sampler and the engine core's measured mode. No vLLM imports.

Settings: the names `make_meter` accepts (`auto`, `nvml`, `rapl`, `cpu-estimate`, `simulated`),
`external:PATH` (a wall meter's CSV power log whose timestamps are Unix epoch seconds on this
host's clock), or `module:callable` returning a Meter (called with no arguments).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from vllm_piep.clock import now_ns
from vllm_piep.meters.auto import auto_meter, make_meter
from vllm_piep.meters.common import CompositeMeter, Meter
from vllm_piep.meters.setting import parse_meter_setting
from vllm_piep.once import logger

MeterFactory = Callable[[], Meter]


def meter_factory(setting: str, cuda_devices: int | Sequence[int] | None = None,
                  measuring_only: bool = False, nvml_indices: Sequence[int] | None = None
                  ) -> tuple[MeterFactory, str]:
    """(a function that builds and returns the meter, unstarted; a label naming it in logs);
    ValueError for a setting that is not one (`meters.setting`). The GPUs the NVML meter
    (named, or chosen by `auto`) meters: `cuda_devices`, CUDA ordinals of this process (a count
    n: ordinals 0..n-1), or `nvml_indices`; neither: every GPU CUDA sees. `measuring_only`:
    `auto` picks a meter that measures (NVML, RAPL) or raises MeterError, never the CPU
    estimate."""
    parsed = parse_meter_setting(setting)
    if parsed.kind == "external":
        return (lambda: _external(parsed.name)), parsed.label
    if parsed.kind == "callable":
        return (lambda: _imported(parsed.name, parsed.attr)), parsed.label
    key = parsed.name
    if isinstance(cuda_devices, int):
        cuda_devices = range(cuda_devices)
    gpus = GpuChoice(None if cuda_devices is None else tuple(cuda_devices),
                     None if nvml_indices is None else tuple(nvml_indices))
    if key == "auto":
        return (lambda: _auto(gpus, measuring_only)), key
    if key == "nvml":
        return (lambda: _nvml(gpus)), key
    if key == "amdsmi":
        return (lambda: _amdsmi(gpus)), key
    if key == "nvml+rapl":
        return (lambda: CompositeMeter(parts=[_nvml(gpus), make_meter("rapl")])), key
    return (lambda: make_meter(key)), key


def reads_gpus(setting: str) -> bool:
    """Whether this setting meters the instance's GPUs (NVML or AMD SMI; `auto` does on a
    GPU)."""
    parsed = parse_meter_setting(setting)
    return parsed.kind == "name" and parsed.name in ("auto", "nvml", "amdsmi", "nvml+rapl")


class GpuChoice(NamedTuple):
    """Which GPUs an NVML meter reads: CUDA ordinals, NVML indices, or (both None) every GPU
    CUDA sees."""

    ordinals: tuple[int, ...] | None = None
    indices: tuple[int, ...] | None = None

    @property
    def instance(self) -> bool:
        return self.ordinals is not None or self.indices is not None


def _nvml(gpus: GpuChoice) -> Meter:
    from vllm_piep.meters.nvml import NvmlMeter

    if gpus.indices is not None:
        return NvmlMeter(indices=list(gpus.indices))
    return NvmlMeter(cuda_devices=None if gpus.ordinals is None else list(gpus.ordinals))


def _amdsmi(gpus: GpuChoice) -> Meter:
    """The AMD meter of the instance's GPUs: HIP ordinals are what vLLM's CUDA ordinals are on
    ROCm; physical device IDs (`--device-ids`, the `indices`) are AMD SMI's own order, before
    the visible-device variables."""
    from vllm_piep.meters.amdsmi import AmdSmiMeter

    if gpus.indices is not None:
        return AmdSmiMeter(hip_devices=list(gpus.indices), environ={})
    return AmdSmiMeter(hip_devices=None if gpus.ordinals is None else list(gpus.ordinals))


def _auto(gpus: GpuChoice, measuring_only: bool) -> Meter:
    from vllm_piep.meters.common import NoMeter

    if measuring_only and gpus.instance:
        # A GPU instance: its GPUs, not the host's CPU packages (RAPL reads the whole socket,
        # other processes' work included).
        from vllm_piep.meters.amdsmi import AmdSmiMeter
        from vllm_piep.meters.auto import _nvml_available

        if _nvml_available():
            meter = _nvml(gpus)
        elif AmdSmiMeter.available():
            meter = _amdsmi(gpus)
        else:
            raise NoMeter("no meter measures this instance's GPUs (neither NVML nor AMD SMI "
                          "is available)")
        logger.info("vllm_piep: meter auto chose %s for the instance's GPUs", meter.name)
        return meter
    meter, why = auto_meter(nvml_factory=lambda: _nvml(gpus), amd_factory=lambda: _amdsmi(gpus))
    if measuring_only and meter.source != "measured":
        raise NoMeter(f"no meter measures this machine's energy ({why})")
    logger.info("vllm_piep: meter auto chose %s: %s", meter.name, why)
    return meter


def _external(path: str) -> Meter:
    from vllm_piep.meters.external import ExternalLogMeter, align_offset

    # A live log is stamped with the wall clock; map epoch seconds to CLOCK_MONOTONIC now.
    return ExternalLogMeter(path, clock_offset_s=align_offset(time.time(), now_ns()))


def _imported(module: str, attr: str) -> Meter:
    meter = getattr(importlib.import_module(module), attr)()
    if not isinstance(meter, Meter):
        raise TypeError(f"{module}:{attr} returned {meter!r}, not a Meter")
    return meter
