"""How the plugin is switched on: VLLM_PLUGINS=piep works like --plugins piep (and a `piep` key
in --additional-config: the server of tests/e2e/test_serve_bundle_faults.py is switched on by
that alone); without any of them vLLM is untouched; a misspelt name is refused before anything
starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.servers import serve

from vllm_piep.meters.resources import window_features
from vllm_piep.spans.reader import read_span_file, span_files
from vllm_piep.tools.server import ServerOptions

pytestmark = pytest.mark.server


def ask(server) -> dict:
    return server.post("/v1/completions", {"model": "model", "prompt": "def f():",
                                           "max_tokens": 6, "ignore_eos": True})


def test_env_allowlist_turns_the_plugin_on_and_env_spans_dir_writes_step_spans(
        tiny_model: Path, tmp_path: Path) -> None:
    spans_dir = tmp_path / "spans"
    options = ServerOptions(model=str(tiny_model), plugin="env",
                            extra_env={"PIEP_SPANS_DIR": str(spans_dir),
                                       "PIEP_RESOURCE_INTERVAL_S": "0.05"})
    for server in serve(options, tmp_path):
        energy = ask(server)["usage"]["energy"]
        assert energy["joules"] > 0 and energy["source"] == "prior"
        assert "piep_energy_joules_total" in server.get_text("/metrics")
        assert "--plugins" not in server.command()
    # Serve mode with a spans directory: every step's span, nothing more (read after the stop,
    # which flushes the file).
    (path,) = span_files(spans_dir)
    span = read_span_file(path)
    assert span.header.mode == "step" and span.header.tree is None
    assert span.header.shape is not None and span.header.shape["hidden"] == 128
    assert span.modules.empty and span.collectives.empty
    steps = span.steps
    assert len(steps) >= 6 and list(steps["step"]) == list(range(len(steps)))
    assert (steps["end_ns"] > steps["start_ns"]).all()
    assert (steps["start_ns"].iloc[1:].values >= steps["end_ns"].iloc[:-1].values).all()
    assert steps["decode_tokens"].sum() >= 5  # the 6-token answer: 5 tokens fed back
    # Resource features sampled into the same file, and averaged over a step's window.
    res = span.resources
    assert len(res) >= 10 and {"cpu_util", "cpu_mem_util", "process_rss_bytes"} <= set(res)
    assert (res["t_ns"].diff().dropna() > 0).all()
    last = steps.iloc[-1]
    features = window_features(res, int(last["start_ns"]), int(last["end_ns"]))
    assert features["process_rss_bytes"] > 0 and 0 <= features["cpu_util"] <= 100


def test_without_the_plugin_vllm_is_untouched(tiny_model: Path, tmp_path: Path) -> None:
    for server in serve(ServerOptions(model=str(tiny_model), plugin="off"), tmp_path):
        response = ask(server)
        assert "energy" not in response["usage"]
        assert response["usage"]["completion_tokens"] == 6
        assert "piep_" not in server.get_text("/metrics")
        assert "per-request energy is on" not in server.log_path.read_text()


def test_misspelt_plugin_name_is_a_clear_error(tiny_model: Path) -> None:
    vllm = str(Path(sys.executable).with_name("vllm"))
    result = subprocess.run([vllm, "serve", str(tiny_model), "--plugins", "pieep"],
                            capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "unknown vLLM plugin 'pieep'. Did you mean 'piep'?" in result.stderr
