"""Pick the predictor the serve path uses: a configured factory, a calibrated bundle (a path,
or `auto`: the first shipped bundle -- `vllm_piep/bundles`, linked as `models/` -- that fits
this model and hardware), else the analytic prior. The check before serving starts loads it
`strict`: a configured bundle or prior correction that cannot serve this model here (missing,
corrupt, for another model or hardware) stops the start in one line. Past that check (an
engine on another host, `auto` finding none) a bundle that cannot be used falls back to the
prior with one warning that says why.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from vllm_piep.config import PiepConfig
from vllm_piep.model.devices import (
    DeviceProfile,
    DeviceSpec,
    GpuFacts,
    UnknownDevice,
    _read_cpuinfo,
    generic_gpu_spec,
    resolve_spec,
)
from vllm_piep.model.flops import ModelShape
from vllm_piep.once import logger
from vllm_piep.predict.base import Predictor
from vllm_piep.predict.prior import PriorPredictor, prior_id

# Shipped bundles: package data, so that a wheel install finds them too (`models/` at the
# repository root links here).
MODELS_DIR = Path(__file__).resolve().parents[1] / "bundles"


def device_name_of(device_type: str, device_name: str | None) -> str:
    """The name bundles are matched on: the GPU's name, or the CPU's model name."""
    if device_name:
        return device_name
    if device_type == "cpu":
        return _read_cpuinfo().get("model name", "")
    return ""


def shipped_bundles(directory: Path = MODELS_DIR) -> list[Path]:
    return sorted(p.parent for p in directory.glob("*/manifest.json"))


def device_spec(requested: str, device_type: str, device_name: str | None,
                gpu_facts: Callable[[], GpuFacts] | None = None,
                cpu_cores: int | None = None) -> DeviceSpec:
    """The datasheet profile of the device; for a GPU none fits, a generic one from what
    `gpu_facts` (NVML or AMD SMI) reports, with one warning. Never fails for a GPU: energy is never
    silently absent."""
    try:
        return resolve_spec(requested, device_type, device_name, cpu_cores)
    except UnknownDevice as exc:
        name = device_name or f"unknown {device_type} device"
        try:
            facts = gpu_facts() if gpu_facts is not None else GpuFacts(name)
        except Exception as facts_exc:  # noqa: BLE001  (no GPU tool: the medians serve)
            logger.info("vllm_piep: neither NVML nor AMD SMI can describe %r (%s)", name,
                        facts_exc)
            facts = GpuFacts(name)
        spec = generic_gpu_spec(facts)
        logger.warning("vllm_piep: %s; pricing with %s built from what %s reports (%s). "
                       "Set device_profile, or calibrate a bundle on this GPU, for better "
                       "numbers.", exc, spec.name, facts.tool, spec.source)
        return spec


def load_predictor(config: PiepConfig, shape: ModelShape, device_type: str,
                   device_name: str | None, architecture: str | None = None,
                   gpu_facts: Callable[[], GpuFacts] | None = None,
                   cpu_cores: int | None = None, strict: bool = False) -> Predictor:
    """The configured predictor (`module:callable`, called with the config, shape and
    device), else the configured bundle, else the analytic prior for the detected device
    (`gpu_facts` describes a GPU no profile fits, for a generic one). `strict` (the check
    before serving starts): a bundle directory that cannot serve raises BundleUnfit instead of
    falling back to the prior."""
    if config.predictor:
        module_name, _, attr = config.predictor.partition(":")
        if not attr:
            raise ValueError(f"predictor must be 'module:callable', got {config.predictor!r}")
        factory = getattr(importlib.import_module(module_name), attr)
        predictor = factory(config=config, shape=shape, device_type=device_type,
                            device_name=device_name)
        if not isinstance(predictor, Predictor):
            raise TypeError(f"{config.predictor} did not return a Predictor: {predictor!r}")
        return predictor
    profile, problem = _profile(config, shape, device_type, device_name, gpu_facts, cpu_cores)
    if config.bundle:
        bundle = _load_bundle(config.bundle, shape, device_type, device_name, architecture,
                              profile, strict)
        if bundle is not None:
            return bundle
    if profile is None:
        raise problem  # type: ignore[misc]
    if config.prior_correction:
        return _corrected_prior(config.prior_correction, shape, profile, strict)
    return PriorPredictor(shape, profile)


def check_predictor(config: PiepConfig, shape: ModelShape, device_type: str,
                    device_name: str | None, architecture: str | None = None,
                    gpu_facts: Callable[[], GpuFacts] | None = None,
                    cpu_cores: int | None = None) -> tuple[str, str]:
    """(bundle id, source) of the predictor the engines will build, checked as
    `load_predictor(strict=True)` checks it, in a process that does not predict: the plain
    prior (no bundle, correction or factory) is only resolved to its device profile, so that
    its ONNX graph, and onnxruntime (~36 MB resident), stay out of this process. A predictor
    factory is not run here (the engines run it); ValueError if one is configured."""
    if config.predictor:
        raise ValueError(f"predictor {config.predictor} runs in the engines only")
    if config.bundle or config.prior_correction:
        predictor = load_predictor(config, shape, device_type, device_name, architecture,
                                   gpu_facts, cpu_cores, strict=True)
        return predictor.bundle_id, predictor.source
    profile, problem = _profile(config, shape, device_type, device_name, gpu_facts, cpu_cores)
    if profile is None:
        raise problem  # type: ignore[misc]
    return prior_id(shape, profile), PriorPredictor.source


def _profile(config: PiepConfig, shape: ModelShape, device_type: str, device_name: str | None,
             gpu_facts: Callable[[], GpuFacts] | None, cpu_cores: int | None
             ) -> tuple[DeviceProfile | None, Exception | None]:
    """The device profile the options pick for this device, else (None, why not): an unknown
    profile name, where a bundle can still serve."""
    try:
        return DeviceProfile.from_spec(
            device_spec(config.device_profile, device_type, device_name, gpu_facts, cpu_cores),
            shape.dtype_bytes), None
    except Exception as exc:  # an unknown profile name: a bundle can still serve
        return None, exc


def _corrected_prior(path: str, shape: ModelShape, profile: DeviceProfile,
                     strict: bool = False) -> PriorPredictor:
    """The prior with a meter's correction (`calibrate from-metrics`), if it was measured on
    this prior; else the plain prior, said once (`strict`: ValueError instead). It says
    `calibrated`, or `estimated` / `simulated` where its meter estimates or simulates
    (`PriorPredictor`)."""
    from vllm_piep.predict.correction import PriorCorrection

    plain = PriorPredictor(shape, profile)
    try:
        fit = PriorCorrection.read(path)
    except ValueError as exc:
        if strict:
            raise
        logger.warning("vllm_piep: %s; serving the plain prior", exc)
        return plain
    if fit.bundle != plain.bundle_id:
        if strict:
            raise ValueError(f"prior correction {path} was measured on {fit.bundle}, not on "
                             f"this server's {plain.bundle_id}")
        logger.warning("vllm_piep: prior correction %s was measured on %s, not on this "
                       "server's %s; serving the plain prior", path, fit.bundle,
                       plain.bundle_id)
        return plain
    return PriorPredictor(shape, profile, fit.static_ratio, fit.dynamic_ratio, fit.meter,
                          fit.meter_source)


class BundleUnfit(ValueError):
    """The configured bundle directory cannot serve this model or hardware."""


def _load_bundle(setting: str, shape: ModelShape, device_type: str, device_name: str | None,
                 architecture: str | None, profile: DeviceProfile | None,
                 strict: bool = False) -> Predictor | None:
    from vllm_piep.predict.served import BundlePredictor

    name = device_name_of(device_type, device_name)
    candidates = shipped_bundles() if setting == "auto" else [Path(setting)]
    reasons = []
    for directory in candidates:
        try:
            predictor = BundlePredictor.load(directory, shape, architecture, device_type, name,
                                             profile)
        except Exception as exc:  # a bad bundle must not stop serving: say why, go on
            if strict and setting != "auto":
                raise BundleUnfit(str(exc)) from None
            reasons.append(f"{directory}: {exc}")
            continue
        logger.info("vllm_piep: predicting with bundle %s (%s)", predictor.bundle_id,
                    directory)
        return predictor
    if not candidates:
        reasons.append(f"no bundle in {MODELS_DIR}")
    logger.warning("vllm_piep: no calibrated bundle fits (%s); predicting with the analytic "
                   "prior (responses say \"source\": \"prior\")", "; ".join(reasons))
    return None
