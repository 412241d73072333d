"""Plugin configuration: one typed object, from `--additional-config '{"piep": {...}}'` and
environment variables.

Every option is declared once, in `PiepConfig` below: its name, type, default, environment
variable (`env`) and description; `options_table()` renders them (the README's table is
checked against it). Besides them the plugin reads VLLM_PLUGINS (vLLM's own allowlist: the
plugin is on when it names `piep`) and the PIEP_ variables of `OTHER_VARIABLES` (PIEP_ENABLED
is set to 1 by `--plugins piep` or by a `piep` key in vLLM's additional config, and inherited by
the engine-core and worker processes); any other PIEP_ variable is refused.

Detail mode (`{"piep": {"mode": "detail", "spans_dir": DIR}}` or PIEP_MODE=detail with
PIEP_SPANS_DIR) needs eager execution (`--enforce-eager`): forward hooks never fire inside
torch.compile or CUDA-graph replay. Without it, `vllm serve` stops at once and says so (the
workers check again, for the offline `LLM` API). In serve mode, `spans_dir` makes every rank
write its step spans there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from vllm_piep.meters.setting import parse_meter_setting

PLUGIN_NAME: Final = "piep"
ENV_ENABLED: Final = "PIEP_ENABLED"
ENV_PREFIX: Final = "PIEP_"
# The plugin's environment variables that are not options (those are in `PiepConfig`), with
# what reads them. Any other PIEP_ name is refused: a misspelt option would be ignored.
OTHER_VARIABLES: Final = {
    ENV_ENABLED: "set by `--plugins piep` or a `piep` key; the engine's processes inherit it",
    "PIEP_TINY_MODEL": "scripts/setup.sh and the tests: where the tiny test model is",
    "PIEP_EXPECT_VLLM": "the tests: the vLLM version the contract tests must import",
    "PIEP_CAMPAIGN_DIR": "the tests: a finished campaign for the interval tests",
    "PIEP_GPU_CHECK_COMMIT": "scripts/gpu-check.sh: the commit the results are of",
    "PIEP_WORKER_METER_SINK": "set by an engine core whose workers meter themselves "
                              "(`meter_scope`): where they send their readings",
    "PIEP_WORKER_RANK": "set in a worker that meters itself: its rank, for a "
                        "`module:callable` meter",
}


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
        json_schema_extra={"env": "PIEP_PREDICTOR"},
        default=None, description="`module:callable` returning a Predictor; default: the prior"
    )
    device_profile: str = Field(
        json_schema_extra={"env": "PIEP_DEVICE_PROFILE"},
        default="auto", description="device profile of the prior, or `auto` to detect it"
    )
    mode: Literal["serve", "detail"] = Field(
        json_schema_extra={"env": "PIEP_MODE"},
        default="serve", description="`detail` records module and collective spans (eager only)"
    )
    spans_dir: str | None = Field(
        json_schema_extra={"env": "PIEP_SPANS_DIR"},
        default=None, description="where each rank writes its span file; required by detail"
    )
    resource_interval_s: float = Field(
        json_schema_extra={"env": "PIEP_RESOURCE_INTERVAL_S"},
        default=0.0, ge=0.0, description="resource features into the span files every this "
        "many seconds (0: off)"
    )
    sampling: SamplingConfig | None = Field(
        default=None, description="repeated sampling of modules and collectives (detail mode)"
    )
    bundle: str | None = Field(
        json_schema_extra={"env": "PIEP_BUNDLE"},
        default=None, description="a calibrated bundle's directory (it must fit the model, "
        "dtype and device), or `auto` for a shipped one that fits; default: the prior"
    )
    carbon_intensity: float | None = Field(
        json_schema_extra={"env": "PIEP_CARBON_INTENSITY"},
        default=None, ge=0.0, allow_inf_nan=False, description="grid carbon intensity in "
        "gCO2e/kWh; responses then carry usage.energy.gco2e"
    )
    carbon_intensity_file: str | None = Field(
        json_schema_extra={"env": "PIEP_CARBON_INTENSITY_FILE"},
        default=None, description="a file with the grid intensity (a number, or JSON with "
        "`gco2e_per_kwh` or Electricity Maps' `carbonIntensity`), re-read when it changes"
    )
    meter: str | None = Field(
        json_schema_extra={"env": "PIEP_METER"},
        default=None, description="`auto`, `nvml`, `amdsmi`, `rapl`, `nvml+rapl`, "
        "`cpu-estimate`, `simulated`, `external:PATH` or `module:callable`: measures each step "
        "(measured mode); must start at start-up. Default: docs/meters.md#which-meter-serves"
    )
    meter_scope: Literal["auto", "engine", "worker"] = Field(
        json_schema_extra={"env": "PIEP_METER_SCOPE"},
        default="auto", description="`engine`: `meter` reads the engine's node; `worker`: each "
        "worker its own devices, any node; `auto`: `worker` if workers span nodes"
    )
    prior_correction: str | None = Field(
        json_schema_extra={"env": "PIEP_PRIOR_CORRECTION"},
        default=None, description="a file from `calibrate from-metrics`: a measured "
        "server's ratios for the same prior"
    )
    measured: bool = Field(
        json_schema_extra={"env": "PIEP_MEASURED"},
        default=True, description="measured mode where a meter serves; false: the model only"
    )
    ledger: str | None = Field(
        json_schema_extra={"env": "PIEP_LEDGER"},
        default=None, description="an SQLite file (made if absent) keeping every request's energy "
        "and tenant for billing"
    )
    ledger_flush_s: float = Field(
        json_schema_extra={"env": "PIEP_LEDGER_FLUSH_S"},
        default=1.0, gt=0.0, le=60.0, description="the ledger commits this often (seconds): a "
        "killed server loses at most that much"
    )
    tenant_header: str | None = Field(
        json_schema_extra={"env": "PIEP_TENANT_HEADER"},
        default=None, description="request header naming the ledger's tenant (else the OpenAI "
        "`user` field); trust it only behind a gateway that sets it"
    )
    tenant_hash_key: str | None = Field(
        json_schema_extra={"env": "PIEP_TENANT_HASH_KEY"},
        default=None, description="the ledger keeps HMAC-SHA256 of the tenant under this key, "
        "not the tenant"
    )

    peer_key: str | None = Field(
        json_schema_extra={"env": "PIEP_PEER_KEY"},
        default=None, min_length=16, description="disaggregated prefill/decode: both "
        "instances' HMAC key for the prefill's energy; unset: shown unverified, not added"
    )

    @field_validator("device_profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        from vllm_piep.model.devices import profile_names, unknown_profile_message

        if value.strip().lower() not in ("", *profile_names()):
            raise ValueError(unknown_profile_message(value.strip().lower()))
        return value

    @model_validator(mode="after")
    def _detail_needs_a_directory(self) -> PiepConfig:
        if self.mode == "detail" and not self.spans_dir:
            raise ValueError("detail mode needs `spans_dir` (or PIEP_SPANS_DIR): the directory "
                             "where each rank writes its span file")
        if self.sampling is not None and self.mode != "detail":
            raise ValueError("`sampling` replays modules through detail mode's hooks: set "
                             "mode `detail`")
        return self

    @field_validator("predictor")
    @classmethod
    def _predictor_spelling(cls, value: str | None) -> str | None:
        if value is not None:
            module, _, attr = value.partition(":")
            if not module or not attr.isidentifier():
                raise ValueError("it must be `module:callable`, e.g. `my_pkg.energy:make`")
        return value

    @field_validator("meter")
    @classmethod
    def _meter_spelling(cls, value: str | None) -> str | None:
        if value is not None:
            parse_meter_setting(value)  # checks the spelling; builds nothing
        return value

    @field_validator("tenant_header")
    @classmethod
    def _header_spelling(cls, value: str | None) -> str | None:
        if value is not None:
            value = value.strip().lower()
            if not value or not all(c.isalnum() or c in "!#$%&'*+-.^_`|~" for c in value):
                raise ValueError("it must be an HTTP header name, e.g. `x-tenant-id`")
        return value

    @model_validator(mode="after")
    def _ledger_options_need_a_ledger(self) -> PiepConfig:
        given = self.model_fields_set & {"ledger_flush_s", "tenant_header", "tenant_hash_key"}
        if given and not self.ledger:
            raise ValueError(f"`{sorted(given)[0]}` applies to the billing ledger: set `ledger` "
                             "(or PIEP_LEDGER) to a file too")
        return self

    @model_validator(mode="after")
    def _one_carbon_source(self) -> PiepConfig:
        if self.carbon_intensity is not None and self.carbon_intensity_file is not None:
            raise ValueError("set either `carbon_intensity` (a fixed gCO2e/kWh) or "
                             "`carbon_intensity_file` (a file re-read when it changes), not "
                             "both")
        return self

    @classmethod
    def from_sources(
        cls, additional_config: dict[str, Any] | None, environ: dict[str, str] | None = None,
        config_origin: str = "--additional-config",
    ) -> PiepConfig:
        """The options from vLLM's additional config, else their environment variables.
        `config_origin` names where the additional config came from, for errors: a
        ConfigError's one line names the option, where its value came from and what it
        accepts."""
        env = os.environ if environ is None else environ
        check_variables(env)
        piep = (additional_config or {}).get(PLUGIN_NAME)
        if piep is not None and not isinstance(piep, dict):
            raise ConfigError(f"`{PLUGIN_NAME}` in {config_origin} must be an object of "
                              f"options, e.g. {{\"piep\": {{}}}}, not {piep!r}")
        raw = dict(piep or {})
        # The two carbon options are one setting: --additional-config naming either one wins
        # over both variables (else a file in the config plus a number in the environment
        # would be refused as "both").
        carbon_given = "carbon_intensity" in raw or "carbon_intensity_file" in raw
        for name, variable in env_variables().items():
            if not env.get(variable) or (name.startswith("carbon_") and carbon_given):
                continue
            raw.setdefault(name, env[variable])
        try:
            return cls(**raw)
        except ValidationError as e:
            raise ConfigError(describe_error(
                e, raw, lambda name: origin_of(name, additional_config, env, config_origin))
            ) from None


def origin_of(name: str, additional_config: dict[str, Any] | None,
              environ: Mapping[str, str] | None = None,
              config_origin: str = "--additional-config") -> str:
    """Where option `name`'s value came from, as `from_sources` reads it, for messages: the
    additional config where it names the option, else its environment variable if set."""
    env = os.environ if environ is None else environ
    piep = (additional_config or {}).get(PLUGIN_NAME)
    if isinstance(piep, dict) and name in piep:
        return config_origin
    variable = env_variables().get(name)
    return f"environment variable {variable}" if variable and env.get(variable) else \
        config_origin


def describe_error(error: ValidationError, raw: dict[str, Any],
                   origin: Callable[[str], str]) -> str:
    """pydantic's first error as one line: the option, its value and where it came from
    (`origin`, by option name), what is wrong and what is accepted."""
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"]]
    message = str(first["msg"]).removeprefix("Value error, ")
    if not loc:  # a rule between options: its message names them
        return f"invalid `{PLUGIN_NAME}` options: {message}"
    name = loc[0]
    source = origin(name)
    if first["type"] == "extra_forbidden":
        import difflib

        options = list(PiepConfig.model_fields)
        if len(loc) > 1:  # an unknown key inside a nested option
            options = list(SamplingConfig.model_fields)
            name = ".".join(loc)
        close = difflib.get_close_matches(loc[-1], options, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (f"unknown `{PLUGIN_NAME}` option {name!r} in {source}{hint}; options: "
                f"{', '.join(options)}")
    value = raw.get(name)
    if len(loc) > 1 and isinstance(value, dict):
        value = value.get(loc[1])
    return f"option `{'.'.join(loc)}` = {value!r} (from {source}): {message}"


def _env_of(field: Any) -> str | None:
    extra = field.json_schema_extra
    return extra.get("env") if isinstance(extra, dict) else None


def env_variables() -> dict[str, str]:
    """Option name -> the environment variable that sets it (when the config does not)."""
    return {name: env for name, field in PiepConfig.model_fields.items()
            if (env := _env_of(field)) is not None}


def check_variables(environ: Mapping[str, str]) -> None:
    """ConfigError naming the first PIEP_ environment variable the plugin does not read (and
    the closest one it does), as an unknown key in the additional config is refused."""
    known = [*env_variables().values(), *OTHER_VARIABLES]
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known:
            import difflib

            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            options = sorted(env_variables().values())
            raise ConfigError(f"unknown environment variable {name}{hint}; the options' "
                              f"variables: {', '.join(options)}")


def options_table() -> str:
    """The options as a Markdown table (the README shows it)."""
    lines = ["| option | environment | default | what it does |", "|---|---|---|---|"]
    for name, field in PiepConfig.model_fields.items():
        env = _env_of(field)
        default = "none" if field.default is None else f"`{field.default}`"
        description = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{name}` | {f'`{env}`' if env else 'none'} | {default} | "
                     f"{description} |")
    return "\n".join(lines) + "\n"


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
