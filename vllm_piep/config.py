"""Plugin configuration: one typed object, from `--additional-config '{"piep": {...}}'` and
environment variables.

Environment variables (the only ones the plugin reads):

| variable                 | meaning                                                            |
|--------------------------|--------------------------------------------------------------------|
| VLLM_PLUGINS             | vLLM's own allowlist; the plugin is active when it names `piep`     |
| PIEP_ENABLED        | set to 1 by `--plugins piep`, inherited by engine and worker procs  |
| PIEP_PREDICTOR      | `module:callable` returning a Predictor (default: the analytic prior)|
| PIEP_DEVICE_PROFILE | force a device profile of the prior (e.g. `a100-sxm4-40gb`, `cpu`)  |
"""

from __future__ import annotations

import os
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PLUGIN_NAME: Final = "piep"
ENV_ENABLED: Final = "PIEP_ENABLED"
ENV_PREDICTOR: Final = "PIEP_PREDICTOR"
ENV_DEVICE_PROFILE: Final = "PIEP_DEVICE_PROFILE"


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

    @classmethod
    def from_sources(
        cls, additional_config: dict[str, Any] | None, environ: dict[str, str] | None = None
    ) -> "PiepConfig":
        env = os.environ if environ is None else environ
        raw = dict((additional_config or {}).get(PLUGIN_NAME) or {})
        if env.get(ENV_PREDICTOR):
            raw.setdefault("predictor", env[ENV_PREDICTOR])
        if env.get(ENV_DEVICE_PROFILE):
            raw.setdefault("device_profile", env[ENV_DEVICE_PROFILE])
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
