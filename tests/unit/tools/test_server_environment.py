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


# A stand-in for `vllm serve`: fails as vLLM's API server does when its port is taken, else
# answers every request with an empty JSON object.
FAKE_SERVE = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Answer(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Answer)
except OSError as exc:
    print(f"OSError: {exc}", flush=True)
    sys.exit(1)
server.serve_forever()
"""


def test_a_start_whose_port_another_process_took_starts_again_on_another(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import socket
    import sys

    from vllm_piep.tools import server as server_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # bound, not listening: a connection is refused at once
    picks = iter([taken.getsockname()[1], server_module.free_port()])
    monkeypatch.setattr(server_module, "free_port", lambda: next(picks))
    monkeypatch.setattr(VllmServer, "command",
                        lambda self: [sys.executable, "-c", FAKE_SERVE, "--port", str(self.port)])
    made = VllmServer(ServerOptions(model="/models/m"), log_path=tmp_path / "server.log")
    first = made.port
    try:
        made.start()
        assert made.port != first and made.post("/v1/completions", {}) == {}
    finally:
        made.stop()
        taken.close()
    # A port the caller chose is the caller's: no second try.
    again = socket.socket()
    again.bind(("127.0.0.1", 0))
    fixed = VllmServer(ServerOptions(model="/models/m", port=again.getsockname()[1],
                                     startup_timeout_s=60), log_path=tmp_path / "fixed.log")
    try:
        with pytest.raises(server_module.ServerError, match="Address already in use"):
            fixed.start()
    finally:
        again.close()
