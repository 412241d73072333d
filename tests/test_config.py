"""When the plugin is on, and what its options accept."""

from __future__ import annotations

import argparse

import pytest

from vllm_piep.config import ConfigError, PiepConfig, is_enabled


@pytest.mark.parametrize(("environ", "enabled"), [
    ({}, False),
    ({"VLLM_PLUGINS": "piep"}, True),
    ({"VLLM_PLUGINS": "other, piep"}, True),
    ({"VLLM_PLUGINS": "pieps"}, False),
    ({"VLLM_PLUGINS": ""}, False),
    ({"PIEP_ENABLED": "1"}, True),
    ({"PIEP_ENABLED": "0"}, False),
])
def test_enabled_only_when_asked(environ: dict[str, str], enabled: bool) -> None:
    assert is_enabled(environ) is enabled


def test_options_from_additional_config_and_env() -> None:
    assert PiepConfig.from_sources(None, {}).device_profile == "auto"
    cfg = PiepConfig.from_sources({"piep": {"device_profile": "l4"}},
                                  {"PIEP_PREDICTOR": "m:f", "PIEP_DEVICE_PROFILE": "cpu"})
    assert cfg.device_profile == "l4"  # --additional-config wins over the environment
    assert cfg.predictor == "m:f"
    with pytest.raises(ConfigError, match=r"(?s)invalid `piep` options.*devce_profile"):
        PiepConfig.from_sources({"piep": {"devce_profile": "l4"}}, {})


def test_plugin_list_names_installed_plugins() -> None:
    from vllm_piep.hooks.cli import installed_plugins, parse_plugin_list

    assert "piep" in installed_plugins()  # the package's entry point is installed
    assert parse_plugin_list("piep") == ["piep"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown vLLM plugin 'pieep'. Did you "
                                                         "mean 'piep'"):
        parse_plugin_list("pieep")
    with pytest.raises(argparse.ArgumentTypeError, match="one or more"):
        parse_plugin_list(" , ")
