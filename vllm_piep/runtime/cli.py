"""`vllm serve MODEL --plugins piep`: vLLM has no such flag, so the plugin adds it.

vLLM loads general plugins in the API server before it adds the engine arguments to the parser
(`AsyncEngineArgs.add_cli_args`), so wrapping `EngineArgs.add_cli_args` gets the flag parsed.
`EngineArgs.from_cli_args` then exports PIEP_ENABLED=1, which the engine-core and worker
processes inherit, and turns the plugin on in this process.

A `piep` key in the engine's additional config (`LLM(..., additional_config={"piep": {...}})`,
or `--additional-config`) turns it on the same way: `EngineArgs.create_engine_config` runs in
the user's process before vLLM starts the engine core, and gives the ledger its options there.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from vllm_piep.config import (
    ENV_ENABLED,
    PLUGIN_NAME,
    ConfigError,
    PiepConfig,
    is_enabled,
    origin_of,
)
from vllm_piep.meters.setting import parse_meter_setting
from vllm_piep.runtime.patching import Patch

GENERAL_PLUGINS_GROUP = "vllm.general_plugins"
# What turns the plugin on in this process once the flag names it (`install.activate`, given
# by `install.install_cli_flag`).
_activate: Callable[[], Any] | None = None


def set_activation(activate: Callable[[], Any]) -> None:
    global _activate
    _activate = activate


def installed_plugins() -> list[str]:
    return sorted({ep.name for ep in entry_points(group=GENERAL_PLUGINS_GROUP)})


def parse_plugin_list(value: str) -> list[str]:
    """argparse type of --plugins: names of installed vLLM general plugins, comma-separated."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one or more plugin names, e.g. --plugins piep")
    installed = installed_plugins()
    for name in names:
        if name not in installed:
            close = difflib.get_close_matches(name, installed, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise argparse.ArgumentTypeError(
                f"unknown vLLM plugin {name!r}.{hint} Installed vLLM general plugins: "
                f"{', '.join(installed) or 'none'}."
            )
    return names


def json_error_named(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """--additional-config's argparse type, naming the JSON error in a value that holds
    plugin options (vLLM's own message names its parser function, not the fault); any other
    value keeps vLLM's message."""
    def parse_additional_config(value: str) -> Any:
        try:
            return parse(value)
        except argparse.ArgumentTypeError:
            if f'"{PLUGIN_NAME}"' not in value and f"'{PLUGIN_NAME}'" not in value:
                raise
            try:
                json.loads(value)
            except json.JSONDecodeError as exc:
                raise argparse.ArgumentTypeError(
                    f"not valid JSON ({exc.msg} at column {exc.colno}): {value}; keys and "
                    "strings take double quotes, e.g. '{\"piep\": {\"meter\": \"auto\"}}'"
                ) from None
            raise

    parse_additional_config.piep_wrapped = True  # type: ignore[attr-defined]
    return parse_additional_config


def _wrap_add_cli_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        if not any("--plugins" in a.option_strings for a in parser._actions):
            parser.add_argument(
                "--plugins", type=parse_plugin_list, default=None, metavar="NAME[,NAME]",
                help="Turn on installed vLLM plugins by name, e.g. `--plugins piep` for "
                     "per-request energy in `usage.energy` (same as VLLM_PLUGINS=piep).")
        for action in parser._actions:
            if ("--additional-config" in action.option_strings and callable(action.type)
                    and not getattr(action.type, "piep_wrapped", False)):
                action.type = json_error_named(action.type)
        return parser

    return add_cli_args


# Marks engine arguments made from a command line (`vllm serve`): a setting that cannot take
# effect then stops the command with one line, where `LLM(...)` gets a ConfigError.
FROM_CLI_ATTR = "_piep_from_cli"


def _wrap_from_cli_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        if PLUGIN_NAME in (getattr(args, "plugins", None) or ()):
            _enable_here()
        if is_enabled():
            from vllm_piep.runtime.api_server import outputs

            outputs.configure(_check_options(args), _instance_devices(args),
                              served_model_name(args))
        engine_args = original(cls, args)
        setattr(engine_args, FROM_CLI_ATTR, True)
        return engine_args

    return from_cli_args


def _wrap_create_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        additional = getattr(self, "additional_config", None)
        asked = isinstance(additional, dict) and PLUGIN_NAME in additional
        config = None
        from_cli = getattr(self, FROM_CLI_ATTR, False)
        origin = "--additional-config" if from_cli else "additional_config"
        try:
            if asked or is_enabled():
                from vllm_piep.runtime.api_server import outputs

                # ConfigError (a ValueError) names the bad option; `LLM(...)` raises it, and
                # the plugin stays off.
                config = PiepConfig.from_sources(additional if asked else None,
                                                 config_origin=origin)
                if not is_enabled():
                    _enable_here()
                outputs.configure(config, _instance_devices(self), served_model_name(self))
            vllm_config = original(self, *args, **kwargs)
            if config is not None:
                from vllm_piep.runtime.start_checks import check_settings

                check_settings(config, vllm_config, _instance_devices(self), origin)
        except ConfigError as exc:  # the plugin's own: one line on the command line
            if from_cli:
                raise SystemExit(f"vllm_piep: {exc}") from None
            raise
        return vllm_config

    return create_engine_config


def _enable_here() -> None:
    """On in this process and in the engine-core and worker processes it starts."""
    os.environ[ENV_ENABLED] = "1"
    _copy_to_ray_workers()
    if _activate is not None:
        _activate()


def _copy_to_ray_workers() -> None:
    """Ray workers get only the driver's variables whose names vLLM copies (VLLM_, HF_, ... on
    a Ray cluster started separately): the plugin's must go too, or its workers run without
    it."""
    name = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
    prefixes = [p for p in os.environ.get(name, "").split(",") if p.strip()]
    if "PIEP_" not in prefixes:
        os.environ[name] = ",".join([*prefixes, "PIEP_"])


def _instance_devices(args: argparse.Namespace) -> int:
    """The devices this host's part of the instance uses: every local data-parallel rank's
    tensor x pipeline ranks (vLLM gives rank r of a local DP rank d device d * world + r)."""
    def size(name: str) -> int:
        value = getattr(args, name, None)
        return int(value) if value else 1

    local_dp = getattr(args, "data_parallel_size_local", None)
    dp = int(local_dp) if local_dp else size("data_parallel_size")
    return size("tensor_parallel_size") * size("pipeline_parallel_size") * dp


def served_model_name(args: Any) -> str | None:
    """The name responses give the base model, as vLLM picks it: the first
    `--served-model-name`, else `--model`."""
    names = getattr(args, "served_model_name", None)
    if isinstance(names, str) and names:
        return names
    if isinstance(names, (list, tuple)) and names:
        return str(names[0])
    model = getattr(args, "model", None)
    return str(model) if model else None


def _check_callable(option: str, spelling: str, origin: str) -> None:
    """A `module:callable` option names something importable and callable, or vLLM stops."""
    module, _, attr = spelling.partition(":")
    try:
        factory = getattr(importlib.import_module(module.strip()), attr.strip())
        if not callable(factory):
            raise TypeError(f"{attr!r} is not callable")
    except Exception as exc:  # noqa: BLE001  (any reason: say it and stop)
        raise SystemExit(f"vllm_piep: option `{option}` = {spelling!r} (from {origin}) cannot "
                         f"be used: {type(exc).__name__}: {exc}") from None


def _check_options(args: argparse.Namespace) -> PiepConfig:
    """Fails `vllm serve` at once, in the terminal, rather than in a worker's log later: a bad
    option, a predictor or meter callable that cannot be imported, detail mode without eager
    execution. What the options name (a bundle, a meter, a file) is checked once vLLM's config
    is made (`start_checks.py`)."""
    try:
        config = PiepConfig.from_sources(getattr(args, "additional_config", None))
    except ConfigError as exc:
        raise SystemExit(f"vllm_piep: {exc}") from exc
    additional = getattr(args, "additional_config", None)
    if config.predictor:
        _check_callable("predictor", config.predictor, origin_of("predictor", additional))
    if config.meter and parse_meter_setting(config.meter).kind == "callable":
        _check_callable("meter", config.meter, origin_of("meter", additional))
    if config.mode == "detail" and not getattr(args, "enforce_eager", False):
        raise SystemExit("vllm_piep: detail mode records module spans with forward hooks, "
                         "which never run inside torch.compile or CUDA graphs: add "
                         "--enforce-eager (or use mode `serve`).")
    return config


def patches() -> list[Patch]:
    from vllm.engine.arg_utils import EngineArgs

    return [
        Patch(EngineArgs, "add_cli_args", _wrap_add_cli_args,
              why="adds the --plugins flag to `vllm serve` and the engine CLI; names the "
                  "JSON error of an --additional-config holding `piep` options",
              how="after the original, adds `--plugins NAME[,NAME]` unless the parser has it, "
                  "and wraps --additional-config's type, whose error then says what is wrong "
                  "with the JSON where the value names `piep`",
              until="vLLM has a flag that enables installed general plugins by name"),
        Patch(EngineArgs, "from_cli_args", _wrap_from_cli_args,
              why="turns the plugin on (here and in child processes) when --plugins names it",
              how="before the original: exports PIEP_ENABLED=1 (and PIEP_ to the variables "
                  "Ray copies), activates the plugin, checks its options",
              until="vLLM has a flag that enables installed general plugins by name"),
        Patch(EngineArgs, "create_engine_config", _wrap_create_engine_config,
              why="turns the plugin on when the engine's additional config has a `piep` key "
                  "(`LLM(..., additional_config={\"piep\": {...}})`) and gives this process's "
                  "ledger those options",
              how="before the original: exports PIEP_ENABLED=1 and activates the plugin if "
                  "asked; if on, reads the `piep` options; after it, checks with vLLM's config "
                  "that what they name (bundle, meter, files) can serve (start_checks.py)",
              until="vLLM enables general plugins from the engine config"),
    ]
