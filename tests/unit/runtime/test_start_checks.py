"""Every setting is checked before vLLM starts its engines, against the real vLLM's config of the
tiny model: a bad option stops `vllm serve` with one line naming the option, where its value
came from and what is accepted; what an option names (a bundle, a meter, a carbon file, a prior
correction) must be usable here, or `vllm serve` stops (and `LLM(...)` raises); `bundle: auto`
with nothing that fits warns once and serves the prior. (tests/e2e/test_serve_bundle_faults.py
runs one of these through a real `vllm serve`.)"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from support.paths import SHIPPED_BUNDLE

from vllm_piep.config import ConfigError, PiepConfig
from vllm_piep.runtime import install
from vllm_piep.runtime.api_server import outputs as api
from vllm_piep.runtime.start_checks import StartCheckFailed

pytest.importorskip("vllm")


@pytest.fixture
def cli_patches(monkeypatch: pytest.MonkeyPatch):
    """The --plugins flag installed; the environment and the API server's options (which
    `create_engine_config` sets) restored afterwards, so that no later test in this process
    serves with them."""
    monkeypatch.setenv("PIEP_ENABLED", "0")
    for name in [n for n in os.environ if n.startswith("PIEP_") and n != "PIEP_ENABLED"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY",
                       os.environ.get("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", ""))
    for name in ("_config", "_cuda_devices", "_model_name"):
        monkeypatch.setattr(api, name, getattr(api, name))
    install.install_cli_flag()
    yield
    install.deactivate()


def serve(tiny_model: Path, options: dict[str, Any], dtype: str = "float32") -> None:
    """What `vllm serve MODEL --plugins piep --dtype D --additional-config ...` does before
    its engines start."""
    from vllm.engine.arg_utils import EngineArgs

    args = argparse.Namespace(model=str(tiny_model), plugins=["piep"], dtype=dtype,
                              max_model_len=256, additional_config={"piep": options})
    EngineArgs.from_cli_args(args).create_engine_config()


def offline(tiny_model: Path, options: dict[str, Any], dtype: str = "float32") -> None:
    """What `LLM(model, dtype=D, additional_config={"piep": ...})` does before its engine."""
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs(model=str(tiny_model), dtype=dtype, max_model_len=256,
               additional_config={"piep": options}).create_engine_config()


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_an_unknown_device_profile_stops_at_once_naming_its_source(
        cli_patches, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIEP_DEVICE_PROFILE", "h100")
    with pytest.raises(SystemExit) as stopped:
        serve(tiny_model, {})
    line = one_line(stopped.value)
    assert line.startswith("vllm_piep: option `device_profile` = 'h100' (from environment "
                           "variable PIEP_DEVICE_PROFILE): unknown device profile 'h100'")
    assert "did you mean h100-sxm5-80gb" in line and "accepted: auto, cpu, " in line
    monkeypatch.delenv("PIEP_DEVICE_PROFILE")
    with pytest.raises(ConfigError, match=r"^option `device_profile` = 'H200' \(from "
                                          r"additional_config\)"):
        PiepConfig.from_sources({"piep": {"device_profile": "H200"}}, environ={},
                                config_origin="additional_config")
    assert PiepConfig.from_sources({"piep": {"device_profile": "H100-SXM5-80GB"}},
                                   environ={}).device_profile == "H100-SXM5-80GB"


def test_an_unknown_piep_variable_stops_at_once_naming_the_close_one(
        cli_patches, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIEP_METR", "auto")
    with pytest.raises(SystemExit) as stopped:
        serve(tiny_model, {})
    line = one_line(stopped.value)
    assert line.startswith("vllm_piep: unknown environment variable PIEP_METR (did you mean "
                           "PIEP_METER?); the options' variables: PIEP_BUNDLE, ")
    with pytest.raises(ConfigError, match="unknown environment variable PIEP_METR "):
        offline(tiny_model, {})
    # The plugin's own variables that are not options are not refused.
    assert PiepConfig.from_sources(None, environ={
        "PIEP_ENABLED": "1", "PIEP_TINY_MODEL": "/m", "PIEP_METER": "auto"}).meter == "auto"


@pytest.mark.parametrize(("options", "environ", "expected"), [
    ({"devce_profile": "auto"}, {},
     "unknown `piep` option 'devce_profile' in --additional-config (did you mean "
     "'device_profile'?); options: predictor, device_profile, "),
    ({}, {"PIEP_METER": "nvm"},
     "option `meter` = 'nvm' (from environment variable PIEP_METER): unknown meter 'nvm'; use "
     "one of auto, nvml, amdsmi, "),
    ({}, {"PIEP_CARBON_INTENSITY": "high"},
     "option `carbon_intensity` = 'high' (from environment variable PIEP_CARBON_INTENSITY): "
     "Input should be a valid number"),
    ({"mode": "fast"}, {}, "option `mode` = 'fast' (from --additional-config): Input should be "
     "'serve' or 'detail'"),
    ({"mode": "detail", "spans_dir": "/tmp/s", "sampling": {"windows": 1}}, {},
     "option `sampling.windows` = 1 (from --additional-config): Input should be greater than "
     "or equal to 2"),
    ({"predictor": "energy"}, {}, "option `predictor` = 'energy' (from --additional-config): it "
     "must be `module:callable`"),
])
def test_a_bad_option_is_one_line_naming_it_and_its_source(
        options: dict[str, Any], environ: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as refused:
        PiepConfig.from_sources({"piep": options}, environ=environ)
    assert one_line(refused.value).startswith(expected), refused.value


def test_a_bundle_that_cannot_serve_stops_serving_before_the_engines(
        cli_patches, tiny_model: Path, tmp_path: Path) -> None:
    # The shipped bundle is calibrated on the tiny model in float32: bfloat16 cannot use it.
    with pytest.raises(SystemExit) as stopped:
        serve(tiny_model, {"bundle": str(SHIPPED_BUNDLE)}, dtype="bfloat16")
    line = one_line(stopped.value)
    assert line.startswith(f"vllm_piep: option `bundle` = '{SHIPPED_BUNDLE}' (from "
                           "--additional-config) cannot serve this model here: ")
    assert "dtype of 2 bytes (bundle: 4)" in line
    with pytest.raises(StartCheckFailed, match=r"option `bundle` = '.*nothing' \(from "
                                               r"additional_config\) cannot serve .*manifest"):
        offline(tiny_model, {"bundle": str(tmp_path / "nothing")})
    offline(tiny_model, {"bundle": str(SHIPPED_BUNDLE)})  # float32: it serves


def test_bundle_auto_with_nothing_that_fits_warns_once_at_start_and_serves_the_prior(
        cli_patches, tiny_model: Path, piep_logs) -> None:
    serve(tiny_model, {"bundle": "auto"}, dtype="bfloat16")
    warnings = piep_logs.messages()
    assert len(warnings) == 1 and "no calibrated bundle fits" in warnings[0], warnings
    assert any("energy will be priced by prior/" in m for m in piep_logs.messages(logging.INFO))


def test_a_meter_named_explicitly_must_start(cli_patches, tiny_model: Path,
                                             tmp_path: Path) -> None:
    log = tmp_path / "wall.csv"
    with pytest.raises(SystemExit) as stopped:
        serve(tiny_model, {"meter": f"external:{log}"})
    line = one_line(stopped.value)
    assert line.startswith(f"vllm_piep: option `meter` = 'external:{log}' (from "
                           "--additional-config) cannot start here (MeterError: ")
    assert "No such file" in line
    serve(tiny_model, {"meter": "simulated"})  # a meter that starts: vLLM goes on
    serve(tiny_model, {"meter": "auto"})  # auto never stops serving


def test_a_carbon_file_that_cannot_be_read_at_start_stops_serving(
        cli_patches, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    path = tmp_path / "intensity.json"
    monkeypatch.setenv("PIEP_CARBON_INTENSITY_FILE", str(path))
    with pytest.raises(SystemExit) as stopped:
        serve(tiny_model, {})
    assert one_line(stopped.value).startswith(
        f"vllm_piep: option `carbon_intensity_file` = '{path}' (from environment variable "
        "PIEP_CARBON_INTENSITY_FILE): No such file or directory.")
    path.write_text(json.dumps({"co2": 300}))
    with pytest.raises(SystemExit, match="none of the keys gco2e_per_kwh, carbonIntensity"):
        serve(tiny_model, {})
    path.write_text(json.dumps({"carbonIntensity": 300}))
    serve(tiny_model, {})


def test_a_prior_correction_that_cannot_be_used_stops_serving(
        cli_patches, tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "fit.json"
    path.write_text("{")
    with pytest.raises(StartCheckFailed, match=r"option `prior_correction` = '.*fit.json' "
                                               r"\(from additional_config\): prior correction "
                                               r".*not JSON"):
        offline(tiny_model, {"prior_correction": str(path)})


def test_a_billing_ledger_that_cannot_be_written_or_is_no_ledger_stops_serving(
        cli_patches, tiny_model: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "energy.db"
    with pytest.raises(SystemExit) as stopped:
        serve(tiny_model, {"ledger": str(missing)})
    assert one_line(stopped.value) == (
        f"vllm_piep: option `ledger` = '{missing}' (from --additional-config): {missing}: its "
        f"directory {missing.parent} does not exist")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"\x00garbage" * 600)
    with pytest.raises(StartCheckFailed, match="junk.db: not a readable ledger"):
        offline(tiny_model, {"ledger": str(junk)})
    serve(tiny_model, {"ledger": str(tmp_path / "energy.db")})  # made, then vLLM goes on
    assert (tmp_path / "energy.db").is_file()


def test_the_plain_priors_check_names_what_the_engines_build_without_onnxruntime(
        tiny_model: Path) -> None:
    """The API server does not predict: checking the plain prior resolves its device profile
    and says the id the engines' predictor will carry, and leaves onnxruntime unimported (36 MB
    resident otherwise); a bundle is still loaded whole to be checked."""
    import subprocess
    import sys

    script = f"""
import json, sys
from vllm_piep.config import PiepConfig
from vllm_piep.model.flops import ModelShape
from vllm_piep.predict.loader import check_predictor
shape = ModelShape.from_hf_config(json.load(open({str(tiny_model / "config.json")!r})), 4)
checked = check_predictor(PiepConfig(), shape, "cpu", None, "LlamaForCausalLM", cpu_cores=2)
light = "onnxruntime" not in sys.modules
from vllm_piep.predict.loader import load_predictor
built = load_predictor(PiepConfig(), shape, "cpu", None, "LlamaForCausalLM", cpu_cores=2)
options = PiepConfig(bundle={str(SHIPPED_BUNDLE)!r})
bundle = check_predictor(options, shape, "cpu", None, "LlamaForCausalLM", cpu_cores=2)
loaded = load_predictor(options, shape, "cpu", None, "LlamaForCausalLM", cpu_cores=2)
print(json.dumps([checked, [built.bundle_id, built.source], light, bundle,
                  [loaded.bundle_id, loaded.source]]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    checked, built, light, bundle, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert checked == built and checked[1] == "prior" and light
    assert bundle == loaded and bundle[1] != "prior", bundle
    with pytest.raises(ValueError, match="unknown device profile"):
        from vllm_piep.model.flops import ModelShape
        from vllm_piep.predict.loader import check_predictor

        shape = ModelShape.from_hf_config(json.loads((tiny_model / "config.json").read_text()),
                                          4)
        check_predictor(PiepConfig(device_profile="h100"), shape, "cpu", None, cpu_cores=2)
