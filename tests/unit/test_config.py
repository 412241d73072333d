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
    with pytest.raises(ConfigError, match=r"unknown `piep` option 'devce_profile'"):
        PiepConfig.from_sources({"piep": {"devce_profile": "l4"}}, {})


def test_plugin_list_names_installed_plugins() -> None:
    from vllm_piep.runtime.cli import installed_plugins, parse_plugin_list

    assert "piep" in installed_plugins()  # the package's entry point is installed
    assert parse_plugin_list("piep") == ["piep"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown vLLM plugin 'pieep'. Did you "
                                                         "mean 'piep'"):
        parse_plugin_list("pieep")
    with pytest.raises(argparse.ArgumentTypeError, match="one or more"):
        parse_plugin_list(" , ")


def test_carbon_intensity_options() -> None:
    assert PiepConfig.from_sources(None, {}).carbon_intensity is None
    cfg = PiepConfig.from_sources(None, {"PIEP_CARBON_INTENSITY": "350.5"})
    assert cfg.carbon_intensity == 350.5 and cfg.carbon_intensity_file is None
    cfg = PiepConfig.from_sources(None, {"PIEP_CARBON_INTENSITY_FILE": "/run/ci.json"})
    assert cfg.carbon_intensity_file == "/run/ci.json" and cfg.carbon_intensity is None
    # --additional-config naming either option wins over both variables, without a conflict
    cfg = PiepConfig.from_sources({"piep": {"carbon_intensity_file": "/run/ci.json"}},
                                  {"PIEP_CARBON_INTENSITY": "350"})
    assert cfg.carbon_intensity_file == "/run/ci.json" and cfg.carbon_intensity is None
    for raw, environ in [
        ({"carbon_intensity": 350, "carbon_intensity_file": "/run/ci.json"}, {}),
        ({}, {"PIEP_CARBON_INTENSITY": "350", "PIEP_CARBON_INTENSITY_FILE": "/run/ci.json"}),
    ]:
        with pytest.raises(ConfigError, match="either `carbon_intensity`.*not both"):
            PiepConfig.from_sources({"piep": raw}, environ)
    for bad in ("-1", "nan", "inf", "lots"):
        with pytest.raises(ConfigError, match="carbon_intensity"):
            PiepConfig.from_sources(None, {"PIEP_CARBON_INTENSITY": bad})


def test_meter_option() -> None:
    assert PiepConfig.from_sources(None, {}).meter is None  # off by default
    assert PiepConfig.from_sources(None, {"PIEP_METER": "auto"}).meter == "auto"
    cfg = PiepConfig.from_sources({"piep": {"meter": "external:/var/log/wall.csv"}},
                                  {"PIEP_METER": "rapl"})
    assert cfg.meter == "external:/var/log/wall.csv"
    with pytest.raises(ConfigError, match="needs its power log"):
        PiepConfig.from_sources({"piep": {"meter": "external"}}, {})


def test_the_readme_shows_every_option_as_declared() -> None:
    """Options are declared once (`PiepConfig`); the README's table is that declaration."""
    from support.paths import ROOT

    from vllm_piep.config import env_variables, options_table

    assert options_table() in (ROOT / "README.md").read_text(), (
        "paste `python -c 'from vllm_piep.config import options_table; "
        "print(options_table())'` into README.md")
    assert set(env_variables().values()) == {f"PIEP_{n.upper()}" for n in env_variables()}
