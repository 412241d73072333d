"""Pick the predictor the serve path uses."""

from __future__ import annotations

import importlib

from vllm_piep.config import PiepConfig
from vllm_piep.flops import ModelShape
from vllm_piep.predict.base import Predictor
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.predict.profiles import DeviceProfile, resolve_spec


def load_predictor(
    config: PiepConfig, shape: ModelShape, device_type: str, device_name: str | None
) -> Predictor:
    """The configured predictor (`module:callable`, called with the config, shape and
    device), else the analytic prior for the detected device."""
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
    spec = resolve_spec(config.device_profile, device_type, device_name)
    return PriorPredictor(shape, DeviceProfile.from_spec(spec, shape.dtype_bytes))
