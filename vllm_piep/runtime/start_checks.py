"""The plugin's settings checked once, in the process that starts vLLM's engines (the API server
of `vllm serve`, or the `LLM` user's process), before the engines start: every setting that
names something outside the options themselves must be usable here and now, or serving does not
start.

- `device_profile`, `bundle` and `prior_correction`: the predictor the engines will build is
  built here with the same inputs (the model's shape, the first GPU's name; the plain prior is
  only resolved to its device profile, which keeps onnxruntime out of the API server); a bundle
  directory that cannot serve this model, dtype or device, or a correction that cannot be read
  or was measured on another prior, stops serving. `bundle: auto` is a preference, not a demand: when
  no shipped bundle fits, the prior serves, said here in one warning line.
- `meter`: a meter named explicitly must start (NVML present, RAPL readable, the external log
  there); `auto` and the default never stop serving (measured mode is then off, and
  `piep_engine_measured` says why). With `meter_scope: worker` the meter runs in the workers,
  maybe on other nodes, and is not tried here: a worker whose meter cannot start sends the
  engine to prediction mode, said in the log and on /metrics.
- `carbon_intensity_file`: the file must hold a valid intensity at start; later problems keep
  the last good value (`carbon.py`).
- `ledger`: the billing ledger must open for writing (its directory there, the file a ledger
  of this schema or absent, the disk not full); later write failures count dropped rows and
  never stop serving (`vllm_piep/ledger/writer.py`).

A predictor factory (`predictor`) is only imported here: it runs in the engines.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from vllm_piep.config import ConfigError, PiepConfig, origin_of
from vllm_piep.once import logger


class StartCheckFailed(ConfigError):
    """A setting that cannot take effect; the message names the option and why."""


Origin = Callable[[str], str]  # option name -> where its value came from


def check_settings(config: PiepConfig, vllm_config: Any, cuda_devices: int | None,
                   config_origin: str = "--additional-config") -> None:
    """StartCheckFailed for the first setting that cannot take effect here; `config_origin`:
    what the user calls vLLM's additional config (`--additional-config`, `additional_config`)."""
    additional = getattr(vllm_config, "additional_config", None)

    def origin(name: str) -> str:
        return origin_of(name, additional if isinstance(additional, dict) else None,
                         config_origin=config_origin)

    if config.predictor is None:
        _check_predictor(config, vllm_config, origin)
    if config.meter is not None and config.meter_scope != "worker":  # else it runs elsewhere
        _check_meter(config.meter, cuda_devices, origin)
    if config.carbon_intensity_file is not None:
        _check_carbon_file(config.carbon_intensity_file, origin)
    if config.ledger is not None:
        _check_ledger(config.ledger, origin)


def _check_ledger(path: str, origin: Origin) -> None:
    from vllm_piep.ledger.store import LedgerError, connect

    try:
        connect(path).close()
    except LedgerError as exc:
        raise StartCheckFailed(f"option `ledger` = {path!r} (from {origin('ledger')}): {exc}"
                               ) from None


def _check_predictor(config: PiepConfig, vllm_config: Any, origin: Origin) -> None:
    from vllm_piep.predict.loader import BundleUnfit, check_predictor
    from vllm_piep.runtime.vllm_config import device, engine_cpu_cores, model_shape

    device_type, device_name = device(0)
    if device_type != "cpu" and device_name is None and config.bundle not in (None, "auto"):
        # No GPU to match the bundle against here (the engines run elsewhere): they check it.
        logger.info("vllm_piep: no GPU visible here; the engines check bundle %s",
                    config.bundle)
        return
    from vllm_piep.meters.device_facts import instance_gpu_facts

    architecture = (vllm_config.model_config.architectures or [None])[0]
    try:
        bundle_id, source = check_predictor(
            config, model_shape(vllm_config), device_type, device_name, architecture,
            gpu_facts=partial(instance_gpu_facts, ordinal=0),
            cpu_cores=engine_cpu_cores(vllm_config) if device_type == "cpu" else None)
    except BundleUnfit as exc:
        raise StartCheckFailed(
            f"option `bundle` = {config.bundle!r} (from {origin('bundle')}) cannot serve this "
            f"model here: {exc}. Use a bundle calibrated for this model, dtype and device, "
            "`auto`, or no bundle (the prior)") from None
    except ValueError as exc:  # a prior correction that cannot be used
        raise StartCheckFailed(f"option `prior_correction` = {config.prior_correction!r} (from "
                               f"{origin('prior_correction')}): {exc}") from None
    logger.info("vllm_piep: energy will be priced by %s (source %s)", bundle_id, source)


def _check_meter(setting: str, cuda_devices: int | None, origin: Origin) -> None:
    from vllm_piep.meters.factory import meter_factory
    from vllm_piep.meters.setting import parse_meter_setting

    if parse_meter_setting(setting).name == "auto":
        return
    factory, label = meter_factory(setting, cuda_devices)
    try:
        meter = factory()
        meter.start()
        meter.stop()
    except Exception as exc:  # noqa: BLE001  (whatever stops it: say it and stop)
        raise StartCheckFailed(
            f"option `meter` = {setting!r} (from {origin('meter')}) cannot start here "
            f"({type(exc).__name__}: {exc}); "
            "name a meter that measures this machine, `auto` (the best available, else "
            "prediction only), or none") from None
    logger.info("vllm_piep: meter %s starts here", label)


def _check_carbon_file(path: str, origin: Origin) -> None:
    from vllm_piep.runtime.api_server.carbon import InvalidIntensity, read_intensity_file

    try:
        read_intensity_file(path)
    except OSError as exc:
        reason = exc.strerror or str(exc)
    except InvalidIntensity as exc:
        reason = str(exc)
    else:
        return
    raise StartCheckFailed(
        f"option `carbon_intensity_file` = {path!r} (from {origin('carbon_intensity_file')}): "
        f"{reason}. It must hold the grid's "
        "intensity in gCO2e/kWh (a number, or JSON with `gco2e_per_kwh` or `carbonIntensity`) "
        "when serving starts")
