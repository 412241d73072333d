"""Real servers for test modules."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from vllm_piep.tools.server import ServerOptions, VllmServer

SUPPORT = Path(__file__).resolve().parent


def serve(options: ServerOptions, log_dir: Path) -> Iterator[VllmServer]:
    """A running server for one test module; stopped by PID and cleaned up afterwards."""
    log_dir.mkdir(parents=True, exist_ok=True)
    server = VllmServer(options, log_path=log_dir / "server.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def support_env(**extra: str) -> dict[str, str]:
    """Environment that lets the server's processes import tests/support modules."""
    path = os.pathsep.join(p for p in (str(SUPPORT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **extra}


def leave_after_first_chunk(server: VllmServer, body: dict, timeout_s: float = 60.0) -> None:
    """A streamed request whose client disconnects as soon as the first chunk (its first
    token) arrives: the engine has scheduled it by then, so it has energy to account as left
    behind, however slow the machine (after a fixed delay it may not have been scheduled)."""
    host, port = server.base_url.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(payload)).encode()
                     + b"\r\n\r\n" + payload)
        seen = b""
        while b"data:" not in seen:
            chunk = conn.recv(65536)
            assert chunk, f"the server closed the stream before its first chunk: {seen[-300:]!r}"
            seen += chunk
