"""Real servers for test modules."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.metrics_text import by_label, total
from vllm_piep.tools.server import ServerOptions, VllmServer

SUPPORT = Path(__file__).resolve().parent
# Output tokens of a request whose client leaves at its first token: enough that the engine has
# the abort before the request could finish, however late a loaded machine delivers it.
LONG_TOKENS = 1500


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


def metered_server(model: Path, out: Path, meter: str,
                   *controls: str) -> Iterator[tuple[VllmServer, Path]]:
    """A server whose meter is the stand-in `meter` (`module:callable` in tests/support), which
    logs its readings to out/readings.csv and watches a file out/NAME for each control NAME
    (`STANDIN_NAME`: standin_nvml.py, standin_amd.py; their log: reading_log.py)."""
    env = support_env(PIEP_METER=meter, STANDIN_LOG=str(out / "readings.csv"),
                      **{f"STANDIN_{name.upper()}": str(out / name) for name in controls})
    # Room for requests that outlast a client who leaves (`LONG_TOKENS`).
    options = ServerOptions(model=str(model), max_model_len=LONG_TOKENS + 64, extra_env=env)
    for server in serve(options, out):
        yield server, out


def engine_readings(server: VllmServer, log: Path) -> list[tuple[int, float]]:
    """The (t_ns, joules) readings the server's engine-core processes took of a stand-in meter
    that logs them (`metered_server`), in order."""
    import psutil

    root = psutil.Process(server.pid)
    engines = {p.pid for p in [root, *root.children(recursive=True)]
               if "EngineCore" in p.name()}
    rows = [line.split(",") for line in log.read_text().splitlines()]
    return [(int(t), float(j)) for pid, t, j in rows if int(pid) in engines]


def check_settled_by_the_fit(server: VllmServer, fallbacks_before: float) -> list[str]:
    """After a meter's trouble (a couple of seconds for the engine to report): more steps
    settled by the fit, fitted joules, and every step joule still on a request outcome. Returns
    the server log's lines."""
    time.sleep(2.5)
    metrics = server.get_text("/metrics")
    assert total(metrics, "piep_meter_fallback_steps_total") > fallbacks_before
    assert total(metrics, "piep_meter_fitted_joules_total") > 0
    outcomes = by_label(metrics, "piep_request_outcome_joules_total", "outcome")
    assert math.fsum(outcomes.values()) == pytest.approx(
        total(metrics, "piep_engine_step_joules_total"), rel=1e-9)
    return server.log_path.read_text().splitlines()


def leave_after_first_chunk(server: VllmServer, body: dict, timeout_s: float = 60.0,
                            headers: dict[str, str] | None = None) -> None:
    """A streamed request whose client disconnects as soon as the first chunk (its first
    token) arrives: the engine has scheduled it by then, so it has energy to account as left
    behind, however slow the machine (after a fixed delay it may not have been scheduled)."""
    host, port = server.base_url.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + extra
                     + b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        seen = b""
        while b"data:" not in seen:
            chunk = conn.recv(65536)
            assert chunk, f"the server closed the stream before its first chunk: {seen[-300:]!r}"
            seen += chunk
