"""Real servers for test modules."""

from __future__ import annotations

import os
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
