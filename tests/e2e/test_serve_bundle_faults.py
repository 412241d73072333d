"""Bundles that cannot serve this model never break serving: a corrupt file (a real server), a
bundle made for another model and a missing bundle (at the loader, which every process's
predictor comes from). Each yields the prior's energy and one warning that names the
problem. The server is switched on by the `piep` key of its --additional-config alone (no
--plugins, no VLLM_PLUGINS: tests/e2e/test_serve_modes.py has the other switches)."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.servers import serve

from vllm_piep.config import PiepConfig
from vllm_piep.model.flops import ModelShape
from vllm_piep.once import logger as piep_logger
from vllm_piep.predict.bundle import TreeBundle, content_digest
from vllm_piep.predict.loader import MODELS_DIR, load_predictor
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.tools.server import ServerOptions, VllmServer

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


def prior_with_one_warning(bundle: Path, shape: ModelShape, caplog: pytest.LogCaptureFixture,
                           monkeypatch: pytest.MonkeyPatch) -> str:
    """Loads the predictor as a server's engine does with this bundle configured; asserts it is
    the prior and that exactly one warning was logged, and returns that warning."""
    config = PiepConfig.from_sources({"piep": {"bundle": str(bundle)}}, environ={})
    # Once vLLM is imported (by another test) its "vllm" logger stops propagating to caplog.
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.INFO, logger=piep_logger.name):
        predictor = load_predictor(config, shape, "cpu", None, "LlamaForCausalLM")
    assert isinstance(predictor, PriorPredictor) and predictor.source == "prior"
    # With vLLM's handlers around, one record can reach caplog's handler twice: count records.
    records = {id(r): r for r in caplog.records if r.levelno >= logging.WARNING}
    warnings = [r.getMessage() for r in records.values()]
    assert len(warnings) == 1, warnings
    assert str(bundle) in warnings[0] and "analytic prior" in warnings[0]
    return warnings[0]


def test_missing_bundle_falls_back_at_the_loader(
        tmp_path: Path, shape: ModelShape, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    prior_with_one_warning(tmp_path / "no-such-bundle", shape, caplog, monkeypatch)


def test_a_bundle_for_another_model_falls_back_at_the_loader(
        tmp_path: Path, shape: ModelShape, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = other_model_bundle(tmp_path / "bundle", 2 * shape.hidden)
    warning = prior_with_one_warning(bundle, shape, caplog, monkeypatch)
    assert "does not fit" in warning and \
        f"hidden {shape.hidden} (bundle: {2 * shape.hidden})" in warning


@pytest.fixture(scope="module")
def corrupt(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Path, VllmServer]]:
    """(bundle directory, a server configured with it)."""
    work = tmp_path_factory.mktemp("bundle_fault")
    bundle = corrupt_bundle(work / "bundle")
    config = {"piep": {"bundle": str(bundle), "carbon_intensity": 400}}
    options = ServerOptions(model=str(tiny_model), plugin="off",
                            extra_args=["--additional-config", json.dumps(config)])
    for server in serve(options, work):
        yield bundle, server


@pytest.mark.server
def test_a_corrupt_bundle_serves_with_the_prior_and_one_warning(
        corrupt: tuple[Path, VllmServer]) -> None:
    bundle, server = corrupt
    responses: list[dict[str, Any]] = [
        server.post("/v1/completions", {"model": "model", "prompt": "def f(x):",
                                        "max_tokens": 6, "ignore_eos": True}),
        server.post("/v1/chat/completions", {"model": "model", "max_tokens": 6,
                                             "ignore_eos": True,
                                             "messages": [{"role": "user", "content": "hi"}]}),
    ]
    for response in responses:  # server.post raises on any HTTP error
        assert response["choices"]
        energy = response["usage"]["energy"]
        assert energy["source"] == "prior" and energy["joules"] > 0, energy
        # The configuration reached the plugin, which the `piep` key alone switched on.
        assert energy["gco2e"] == pytest.approx(energy["joules"] / 3.6e6 * 400, rel=1e-9)
    assert "--plugins" not in server.command()
    # The server log repeats the configuration (with the path) at startup: count only the
    # plugin's own lines about this bundle.
    lines = [line for line in server.log_path.read_text(errors="replace").splitlines()
             if "vllm_piep:" in line and str(bundle) in line]
    assert len(lines) == 1, lines
    assert "WARNING" in lines[0] and "analytic prior" in lines[0]
    assert str(bundle / CORRUPT_LEAF) in lines[0]
