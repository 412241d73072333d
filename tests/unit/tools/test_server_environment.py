"""A managed server's environment: its own TMPDIR, which goes when it stops, but torch's own
compiled-kernel cache and no precompiled header (which would live in that TMPDIR), so that a
start reuses what an earlier one compiled and compiles nothing. A tensor-parallel start
compiles vLLM's vocabulary mask even when eager: each one ran g++ for 4-7 s here before."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from vllm_piep.tools.server import ServerOptions, VllmServer


@pytest.fixture
def server() -> Iterator[VllmServer]:
    made = VllmServer(ServerOptions(model="/models/m"))
    yield made
    shutil.rmtree(made._workdir, ignore_errors=True)


def test_the_inductor_cache_is_torchs_own_and_outlives_the_private_tmpdir(
        server: VllmServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = server.environment()
    assert env["TMPDIR"].startswith(str(server._workdir))
    assert env["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
    assert not env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(server._workdir))
    assert env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"


def test_a_users_inductor_cache_is_kept(server: VllmServer,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/data/inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "1")
    env = server.environment()
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/data/inductor"
    assert env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "1"
