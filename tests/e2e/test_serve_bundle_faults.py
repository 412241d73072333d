"""Bundles that cannot serve this model: `vllm serve` refuses to start with one (a real server,
checked before its engines start), and an engine that meets one anyway (another model, a
missing bundle: at the loader, which every process's predictor comes from) serves the prior's
energy with one warning that names the problem. The first server is switched on by the `piep`
key of its --additional-config alone (no --plugins, no VLLM_PLUGINS:
tests/e2e/test_serve_modes.py has the other switches)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_piep.config import PiepConfig
from vllm_piep.model.flops import ModelShape
from vllm_piep.predict.bundle import TreeBundle, content_digest
from vllm_piep.predict.loader import MODELS_DIR, load_predictor
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.tools.server import ServerError, ServerOptions, VllmServer

SHIPPED = MODELS_DIR / "cpu-tiny-llama"
CORRUPT_LEAF = "leaf_003.onnx"


def corrupt_bundle(out: Path) -> Path:
    """The shipped bundle with one leaf truncated to half its bytes."""
    shutil.copytree(SHIPPED, out)
    leaf = out / CORRUPT_LEAF
    data = leaf.read_bytes()
    leaf.write_bytes(data[:len(data) // 2])
    return out


def other_model_bundle(out: Path, hidden: int) -> Path:
    """The shipped bundle re-labelled, consistently, as calibrated on a model with another
    hidden size: a valid bundle, for a model this server does not run."""
    shutil.copytree(SHIPPED, out)
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["serving"]["shape"]["hidden"] = hidden
    manifest["content_sha256"] = content_digest(manifest)
    path.write_text(json.dumps(manifest, indent=1))
    TreeBundle.load(out)  # refused only for the model, not as altered or corrupt
    return out


def prior_with_one_warning(bundle: Path, shape: ModelShape, piep_logs) -> str:
    """Loads the predictor as a server's engine does with this bundle configured; asserts it is
    the prior and that exactly one warning was logged, and returns that warning."""
    config = PiepConfig.from_sources({"piep": {"bundle": str(bundle)}}, environ={})
    predictor = load_predictor(config, shape, "cpu", None, "LlamaForCausalLM")
    assert isinstance(predictor, PriorPredictor) and predictor.source == "prior"
    warnings = piep_logs.messages()
    assert len(warnings) == 1, warnings
    assert str(bundle) in warnings[0] and "analytic prior" in warnings[0]
    return warnings[0]


def test_missing_bundle_falls_back_at_the_loader(
        tmp_path: Path, shape: ModelShape, piep_logs) -> None:
    prior_with_one_warning(tmp_path / "no-such-bundle", shape, piep_logs)


def test_a_bundle_for_another_model_falls_back_at_the_loader(
        tmp_path: Path, shape: ModelShape, piep_logs) -> None:
    bundle = other_model_bundle(tmp_path / "bundle", 2 * shape.hidden)
    warning = prior_with_one_warning(bundle, shape, piep_logs)
    assert "does not fit" in warning and \
        f"hidden {shape.hidden} (bundle: {2 * shape.hidden})" in warning


def stopped_at_start(options: ServerOptions, work: Path) -> tuple[int, list[str]]:
    """Runs `vllm serve` that is to stop before its engines start: (exit code, log lines)."""
    server = VllmServer(options, log_path=work / "server.log")
    with pytest.raises(ServerError, match="exited with") as stopped:
        server.start()
    code = int(str(stopped.value).split("exited with ")[1].split()[0])
    return code, server.log_path.read_text(errors="replace").splitlines()


@pytest.mark.server
def test_bad_settings_stop_vllm_serve_with_one_line(
        tiny_model: Path, tmp_path: Path) -> None:
    """A real `vllm serve` with a bundle that cannot serve (in --additional-config alone, which
    turns the plugin on: no --plugins, no VLLM_PLUGINS) and with an unknown device profile from
    the environment: each stops before the engine starts, non-zero, its last line the plugin's
    one line naming the option, its source and what is accepted; no traceback."""
    bundle = corrupt_bundle(tmp_path / "bundle")
    config = {"piep": {"bundle": str(bundle), "carbon_intensity": 400}}
    code, lines = stopped_at_start(ServerOptions(
        model=str(tiny_model), plugin="off",
        extra_args=["--additional-config", json.dumps(config)]), tmp_path / "bundle-run")
    assert code != 0 and not any("Traceback" in line for line in lines), lines[-30:]
    last = [line for line in lines if line.strip()][-1]
    assert last.startswith(f"vllm_piep: option `bundle` = '{bundle}' (from --additional-config)"
                           " cannot serve this model here: "), last
    assert CORRUPT_LEAF in last

    code, lines = stopped_at_start(ServerOptions(
        model=str(tiny_model), plugin="flag", extra_env={"PIEP_DEVICE_PROFILE": "h100"}),
        tmp_path / "profile-run")
    assert code != 0 and not any("Traceback" in line for line in lines), lines[-30:]
    last = [line for line in lines if line.strip()][-1]
    assert last.startswith("vllm_piep: option `device_profile` = 'h100' (from environment "
                           "variable PIEP_DEVICE_PROFILE): unknown device profile"), last
    assert "accepted: auto, cpu, " in last
