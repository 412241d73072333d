"""A meter from its setting as users write it (`meter` option, PIEP_METER), for any process:
the API server's /metrics sampler and the engine core's measured mode. No vLLM imports.

Settings: the names `make_meter` accepts (`auto`, `nvml`, `rapl`, `cpu-estimate`, `simulated`),
`external:PATH` (a wall meter's CSV power log whose timestamps are Unix epoch seconds on this
host's clock), or `module:callable` returning a Meter (called with no arguments).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable

from vllm_piep.clock import now_ns
from vllm_piep.meters.auto import auto_meter, make_meter
from vllm_piep.meters.common import Meter
from vllm_piep.meters.setting import parse_meter_setting
from vllm_piep.once import logger

MeterFactory = Callable[[], Meter]


def meter_factory(setting: str, cuda_devices: int | None = None,
                  measuring_only: bool = False) -> tuple[MeterFactory, str]:
    """(a function that builds and returns the meter, unstarted; a label naming it in logs);
    ValueError for a setting that is not one (`meters.setting`). `cuda_devices`: how many CUDA
    devices the vLLM instance uses (its ordinals 0..n-1): the NVML meter (named, or chosen by
    `auto`) meters their GPUs only; None: every GPU CUDA sees. `measuring_only`: `auto` picks
    a meter that measures (NVML, RAPL) or raises MeterError, never the CPU estimate."""
    parsed = parse_meter_setting(setting)
    if parsed.kind == "external":
        return (lambda: _external(parsed.name)), parsed.label
    if parsed.kind == "callable":
        return (lambda: _imported(parsed.name, parsed.attr)), parsed.label
    key = parsed.name
    ordinals = None if cuda_devices is None else list(range(cuda_devices))
    if key == "auto":
        return (lambda: _auto(ordinals, measuring_only)), key
    if key == "nvml":
        return (lambda: _nvml(ordinals)), key
    return (lambda: make_meter(key)), key


def _nvml(ordinals: list[int] | None) -> Meter:
    from vllm_piep.meters.nvml import NvmlMeter

    return NvmlMeter(cuda_devices=ordinals)


def _auto(ordinals: list[int] | None, measuring_only: bool) -> Meter:
    from vllm_piep.meters.common import MeterError

    if measuring_only and ordinals is not None:
        # A GPU instance: its GPUs, not the host's CPU packages (RAPL reads the whole socket,
        # other processes' work included).
        from vllm_piep.meters.auto import _nvml_available

        if not _nvml_available():
            raise MeterError("no meter measures this instance's GPUs (NVML is not available)")
        meter = _nvml(ordinals)
        logger.info("vllm_piep: meter auto chose nvml for the instance's GPUs")
        return meter
    meter, why = auto_meter(nvml_factory=lambda: _nvml(ordinals))
    if measuring_only and meter.source != "measured":
        raise MeterError(f"no meter measures this machine's energy ({why})")
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
