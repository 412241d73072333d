"""docs/vllm.md's table of patches: the registry's, the same whichever supported vLLM prints it,
each version's target where they differ (the chat stream)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.paths import ROOT

VLLM_033_SOURCE = ROOT / ".cache" / "vllm033" / "src"  # scripts/setup.sh downloads it


def doc() -> str:
    return (ROOT / "docs" / "vllm.md").read_text()


def test_the_doc_is_the_registry_table() -> None:
    from vllm_piep.runtime.registry import markdown_table

    assert markdown_table() in doc(), "regenerate: python -m vllm_piep.runtime.registry"


def test_the_chat_stream_target_of_each_version_has_its_row() -> None:
    rows = {line.split(" | ")[1]: line.rstrip(" |").rsplit(" | ", 1)[1]
            for line in doc().splitlines() if "OpenAIServingChat.chat_completion_stream" in line}
    assert rows == {"`OpenAIServingChat.chat_completion_stream_generator`": "0.32.0",
                    "`OpenAIServingChat.chat_completion_stream_generator_raw`": "0.33.0"}


def test_the_installed_vllm_is_patched_at_its_own_chat_stream_target() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    from vllm_piep.runtime.api_server.endpoints import patches
    from vllm_piep.runtime.registry import every_version

    [installed] = [p for p in patches() if p.name.startswith("chat_completion_stream")]
    assert installed.name in OpenAIServingChat.__dict__
    assert [p.name for p in every_version(installed)] == [
        "chat_completion_stream_generator", "chat_completion_stream_generator_raw"]


@pytest.mark.slow
def test_vllm_033_prints_the_same_table() -> None:
    if not (VLLM_033_SOURCE / "vllm" / "__init__.py").is_file():
        pytest.skip(f"no vLLM 0.33.0 source at {VLLM_033_SOURCE} (scripts/setup.sh downloads it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(VLLM_033_SOURCE), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "vllm_piep.runtime.registry"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout in doc()
