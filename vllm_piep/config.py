"""Plugin configuration: one typed object, from `--additional-config '{"piep": {...}}'` and
environment variables.

Environment variables (the only ones the plugin reads):

| variable                 | meaning                                                            |
|--------------------------|--------------------------------------------------------------------|
| VLLM_PLUGINS             | vLLM's own allowlist; the plugin is active when it names `piep`     |
| PIEP_ENABLED        | set to 1 by `--plugins piep`, inherited by engine and worker procs  |
| PIEP_PREDICTOR      | `module:callable` returning a Predictor (default: the analytic prior)|
| PIEP_DEVICE_PROFILE | force a device profile of the prior (e.g. `a100-sxm4-40gb`, `cpu`)  |
| PIEP_MODE           | `serve` (default) or `detail` (module and collective spans)        |
| PIEP_SPANS_DIR      | directory for the per-rank span files (`*.spans.jsonl`)             |
| PIEP_RESOURCE_INTERVAL_S | sample resource features into the span files this often (0: off) |
| PIEP_BUNDLE         | a calibrated bundle directory (or `auto`: the best fit in `models/`) |
| PIEP_CARBON_INTENSITY | grid carbon intensity, gCO2e/kWh: adds `usage.energy.gco2e`       |
| PIEP_CARBON_INTENSITY_FILE | a file holding it (a number or JSON), re-read when it changes |
| PIEP_METER          | a meter sampled in the API server (`auto`, `nvml`, `rapl`,          |
|                     | `cpu-estimate`, `simulated`, `external:PATH`, or `module:callable`) |

Detail mode (`{"piep": {"mode": "detail", "spans_dir": DIR}}` or PIEP_MODE=detail with
PIEP_SPANS_DIR) needs eager execution (`--enforce-eager`): forward hooks never fire inside
torch.compile or CUDA-graph replay. Without it, `vllm serve` stops at once and says so (the
workers check again, for the offline `LLM` API). In serve mode, `spans_dir` makes every rank
write its step spans there.
"""

from __future__ import annotations

import os
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PLUGIN_NAME: Final = "piep"
ENV_ENABLED: Final = "PIEP_ENABLED"
ENV_PREDICTOR: Final = "PIEP_PREDICTOR"
ENV_DEVICE_PROFILE: Final = "PIEP_DEVICE_PROFILE"
ENV_MODE: Final = "PIEP_MODE"
ENV_SPANS_DIR: Final = "PIEP_SPANS_DIR"
ENV_RESOURCE_INTERVAL: Final = "PIEP_RESOURCE_INTERVAL_S"
ENV_BUNDLE: Final = "PIEP_BUNDLE"
ENV_CARBON_INTENSITY: Final = "PIEP_CARBON_INTENSITY"
ENV_CARBON_INTENSITY_FILE: Final = "PIEP_CARBON_INTENSITY_FILE"
ENV_METER: Final = "PIEP_METER"


class SamplingConfig(BaseModel):
    """Detail mode's repeated sampling (PIE-P Appendix L): on a sampled step, every module and
    tensor-parallel collective is run again `calls` times back to back, in `windows` windows
    that each last at least `min_window_s` (long enough for the campaign's meter); `calls` is
    the same on every rank of a tensor-parallel group. The first step of every new batch shape
    (requests, prefill or decode) is sampled, then every `every`-th step of that shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    windows: int = Field(default=3, ge=2, description="meter windows per module (>= 2: a spread)")
    min_window_s: float = Field(default=0.1, gt=0.0, description="shortest window, seconds")
    every: int = Field(default=16, ge=1, description="then every this many steps of a shape")
    max_calls: int = Field(default=100_000, ge=1, description="cap on calls per window")
    layers: int = Field(default=0, ge=0, description="decoder layers replayed per sampled "
                        "step, the next ones on the next sampled step (0: all)")


class ConfigError(ValueError):
    """The user's plugin configuration is invalid; the message says what to change."""


class PiepConfig(BaseModel):
    """Options under the `piep` key of vLLM's `--additional-config`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    predictor: str | None = Field(
        default=None, description="`module:callable` returning a Predictor; default: the prior"
    )
    device_profile: str = Field(
        default="auto", description="device profile of the prior, or `auto` to detect it"
    )
    mode: Literal["serve", "detail"] = Field(
        default="serve", description="`detail` records module and collective spans (eager only)"
    )
    spans_dir: str | None = Field(
        default=None, description="where each rank writes its span file; required by detail"
    )
    resource_interval_s: float = Field(
        default=0.0, ge=0.0, description="resource features into the span files every this "
        "many seconds (at least 0.01; 0: off)"
    )
    sampling: SamplingConfig | None = Field(
        default=None, description="repeated sampling of modules and collectives (detail mode)"
    )
    bundle: str | None = Field(
        default=None, description="calibrated bundle directory, or `auto` to pick one from "
        "models/ by model and hardware; default: the analytic prior"
    )
    carbon_intensity: float | None = Field(
        default=None, ge=0.0, allow_inf_nan=False, description="grid carbon intensity in "
        "gCO2e/kWh; responses then carry usage.energy.gco2e"
    )
    carbon_intensity_file: str | None = Field(
        default=None, description="a file with the grid intensity in gCO2e/kWh (a number, or "
        "JSON with `gco2e_per_kwh` or Electricity Maps' `carbonIntensity`), re-read when it "
        "changes; excludes `carbon_intensity`"
    )
    meter: str | None = Field(
        default=None, description="a meter the API server samples for /metrics "
        "(piep_meter_joules_total): `auto`, `nvml`, `rapl`, `cpu-estimate`, `simulated`, "
        "`external:PATH` or `module:callable`; default: none"
    )

    @model_validator(mode="after")
    def _detail_needs_a_directory(self) -> PiepConfig:
        if self.mode == "detail" and not self.spans_dir:
            raise ValueError("detail mode needs `spans_dir` (or PIEP_SPANS_DIR): the directory "
                             "where each rank writes its span file")
        if self.sampling is not None and self.mode != "detail":
            raise ValueError("`sampling` replays modules through detail mode's hooks: set "
                             "mode `detail`")
        return self

    @model_validator(mode="after")
    def _carbon_and_meter(self) -> PiepConfig:
        if self.carbon_intensity is not None and self.carbon_intensity_file is not None:
            raise ValueError("set either `carbon_intensity` (a fixed gCO2e/kWh) or "
                             "`carbon_intensity_file` (a file re-read when it changes), not "
                             "both")
        if self.meter is not None:
            # Lazily: only a server that asks for a meter pays for importing the meters.
            from vllm_piep.runtime.api_server.meter_sampler import meter_factory

            meter_factory(self.meter)  # checks the spelling; builds nothing yet
        return self

    @classmethod
    def from_sources(
        cls, additional_config: dict[str, Any] | None, environ: dict[str, str] | None = None
    ) -> PiepConfig:
        env = os.environ if environ is None else environ
        raw = dict((additional_config or {}).get(PLUGIN_NAME) or {})
        if env.get(ENV_PREDICTOR):
            raw.setdefault("predictor", env[ENV_PREDICTOR])
        if env.get(ENV_DEVICE_PROFILE):
            raw.setdefault("device_profile", env[ENV_DEVICE_PROFILE])
        if env.get(ENV_MODE):
            raw.setdefault("mode", env[ENV_MODE])
        if env.get(ENV_SPANS_DIR):
            raw.setdefault("spans_dir", env[ENV_SPANS_DIR])
        if env.get(ENV_RESOURCE_INTERVAL):
            raw.setdefault("resource_interval_s", env[ENV_RESOURCE_INTERVAL])
        if env.get(ENV_BUNDLE):
            raw.setdefault("bundle", env[ENV_BUNDLE])
        # The two carbon options are one setting: --additional-config naming either one wins
        # over both variables (else a file in the config plus a number in the environment
        # would be refused as "both").
        if "carbon_intensity" not in raw and "carbon_intensity_file" not in raw:
            if env.get(ENV_CARBON_INTENSITY):
                raw["carbon_intensity"] = env[ENV_CARBON_INTENSITY]
            if env.get(ENV_CARBON_INTENSITY_FILE):
                raw["carbon_intensity_file"] = env[ENV_CARBON_INTENSITY_FILE]
        if env.get(ENV_METER):
            raw.setdefault("meter", env[ENV_METER])
        try:
            return cls(**raw)
        except ValidationError as e:
            raise ConfigError(f"invalid `piep` options in --additional-config: {e}") from e


def allowlisted_plugins(environ: dict[str, str] | None = None) -> list[str] | None:
    """vLLM's `VLLM_PLUGINS` allowlist, parsed the way vLLM parses it (None when unset)."""
    env = os.environ if environ is None else environ
    value = env.get("VLLM_PLUGINS")
    if value is None:
        return None
    return [name.strip() for name in value.split(",")]


def is_enabled(environ: dict[str, str] | None = None) -> bool:
    """The plugin acts only when asked: `--plugins piep` or `VLLM_PLUGINS` naming it."""
    env = os.environ if environ is None else environ
    if env.get(ENV_ENABLED) == "1":
        return True
    allowed = allowlisted_plugins(env)
    return allowed is not None and PLUGIN_NAME in allowed
