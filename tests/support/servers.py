"""Real servers for test modules."""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest

from support.metrics_text import by_label, total
from support.quiet import poll, quiet_metrics
from vllm_piep.tools.server import ServerOptions, VllmServer

SUPPORT = Path(__file__).resolve().parent
# Output tokens of a request whose client leaves at its first token: enough that the engine
# mostly has the abort before it could finish (`leave` tells from vLLM's counts which happened).
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
        # The engine opens its meter on a thread of its own; its responses are measured from
        # when /metrics says it measures.
        poll(partial(server.get_text, "/metrics"),
             lambda text: total(text, "piep_engine_measured") >= 1, "the engine measuring",
             show=lambda text: by_label(text, "piep_engine_measured", "reason"))
        yield server, out


def engine_pids(server: VllmServer) -> set[int]:
    """The process ids of the server's engine cores."""
    import psutil

    root = psutil.Process(server.pid)
    return {p.pid for p in [root, *root.children(recursive=True)] if "EngineCore" in p.name()}


def engine_readings(server: VllmServer, log: Path) -> list[tuple[int, float]]:
    """The (t_ns, joules) readings the server's engine-core processes took of a stand-in meter
    that logs them (`metered_server`), in order."""
    engines = engine_pids(server)
    rows = [line.split(",") for line in log.read_text().splitlines()]
    return [(int(t), float(j)) for pid, t, j in rows if int(pid) in engines]


def frozen_meter_settled(server: VllmServer, log: Path) -> tuple[str, float]:
    """With a stand-in meter's counter frozen (its `freeze` control): (/metrics, the counter's
    rise over the engines' readings in `log`) once the engines have sent every joule of it as
    measured steps or idle energy (idle energy goes out about once a second)."""
    def read() -> tuple[str, float]:
        metrics = quiet_metrics(server)
        readings = engine_readings(server, log)
        return metrics, readings[-1][1] - readings[0][1]

    def joules(got: tuple[str, float]) -> dict[str, float]:
        metrics, counter = got
        return {"step": total(metrics, "piep_engine_step_joules_total"),
                "idle": total(metrics, "piep_idle_joules_total"), "counter": counter}

    def sent(got: tuple[str, float]) -> bool:
        seen = joules(got)
        return math.isclose(seen["step"] + seen["idle"], seen["counter"], rel_tol=1e-6)

    return poll(read, sent, "the engines' measured and idle energy reaching the frozen "
                "counter's rise", show=joules)


def check_settled_by_the_fit(server: VllmServer, fallbacks_before: float) -> list[str]:
    """After a meter's trouble, once the engine has reported it (`quiet_metrics`): more steps
    settled by the fit, fitted joules, and every step joule still on a request outcome. Returns
    the server log's lines."""
    metrics = quiet_metrics(server)
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


@dataclass(frozen=True)
class Leavers:
    """Clients that left at their first chunk (`leave`), as vLLM's own counters and the plugin's
    /metrics saw them. A client leaves long before its `max_tokens`, but a starved API server may
    see it go only after the engine has generated them all: vLLM then finished the request
    (outcome `not_returned`: nobody saw its energy); otherwise it aborted it (`aborted`, and
    `unsent` for steps no output carried). vLLM's counts say which happened to how many."""

    count: int
    finished: int  # requests vLLM finished, every token generated, before it saw the client go
    generated: float  # output tokens vLLM's API server counted for them
    outcomes: dict[str, float]  # piep_request_outcome_joules_total's rise over them, by outcome
    step_joules: float  # piep_engine_step_joules_total's rise over them
    metrics: str = field(repr=False)  # /metrics afterwards, the server quiet

    @property
    def aborted(self) -> int:
        """Requests vLLM aborted before their last token."""
        return self.count - self.finished

    def check_booked(self) -> None:
        """Their energy is where the plugin must put it, and only there: every joule of their
        steps once; aborted requests' under `aborted`/`unsent`; finished ones' under
        `not_returned`; none under `finished` (no response showed it)."""
        outcomes = self.outcomes
        assert self.step_joules > 0, self
        assert math.fsum(outcomes.values()) == pytest.approx(self.step_joules, rel=1e-9), self
        assert outcomes.get("finished", 0.0) == 0.0, self
        gone = outcomes.get("aborted", 0.0) + outcomes.get("unsent", 0.0)
        assert (gone > 0) == (self.aborted > 0), self
        assert (outcomes.get("not_returned", 0.0) > 0) == (self.finished > 0), self


def leave(server: VllmServer, body: dict, count: int = 1, concurrency: int = 1,
          headers: dict[str, str] | None = None) -> Leavers:
    """`count` clients (`concurrency` at a time) that each send `body` (a completion with
    ignore_eos: it ends at max_tokens or by abort) and leave at its first chunk
    (`leave_after_first_chunk`), alone on a quiet server; what vLLM and the plugin made of them
    once it is quiet again."""
    assert body.get("ignore_eos") and body.get("max_tokens"), body
    before = quiet_metrics(server)
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda _: leave_after_first_chunk(server, body, headers=headers),
                      range(count)))
    after = quiet_metrics(server)

    def rise(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    then = by_label(before, "piep_request_outcome_joules_total", "outcome")
    left = Leavers(
        count=count, finished=round(rise("vllm:request_success_total", finished_reason="length")),
        generated=rise("vllm:generation_tokens_total"),
        outcomes={k: v - then.get(k, 0.0) for k, v in by_label(
            after, "piep_request_outcome_joules_total", "outcome").items()},
        step_joules=rise("piep_engine_step_joules_total"), metrics=after)
    # vLLM's two counts agree: a finished request generated max_tokens, an aborted one its first
    # token (its client saw it) and fewer than max_tokens.
    most = body["max_tokens"]
    assert 0 <= left.finished <= count, left
    assert (most * left.finished + left.aborted <= left.generated
            <= most * left.finished + (most - 1) * left.aborted), left
    return left
