"""How the plugin is switched on: VLLM_PLUGINS=piep works like --plugins piep; without either
vLLM is untouched; a misspelt name is refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.servers import serve

from vllm_piep.server import ServerOptions

pytestmark = pytest.mark.server


def ask(server) -> dict:
    return server.post("/v1/completions", {"model": "model", "prompt": "def f():",
                                           "max_tokens": 6, "ignore_eos": True})


def test_env_allowlist_turns_the_plugin_on(tiny_model: Path, tmp_path: Path) -> None:
    for server in serve(ServerOptions(model=str(tiny_model), plugin="env"), tmp_path):
        energy = ask(server)["usage"]["energy"]
        assert energy["joules"] > 0 and energy["source"] == "prior"
        assert "piep_energy_joules_total" in server.get_text("/metrics")
        assert "--plugins" not in server.command()


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
