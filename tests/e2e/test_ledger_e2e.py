"""The billing ledger on a real server (`ledger`, `tenant_header`): every request's energy under
its tenant, every joule once (Σ rows = the engine's step energy = /metrics' outcomes), never a
prompt's text; then `kill -9` of the API server under load loses at most the rows of the last
flush interval, leaves the file sound, and a restarted server appends to it."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support.metrics_text import by_label, value
from support.quiet import ledger_settled, poll
from support.servers import LONG_TOKENS, leave, serve

from vllm_piep.tools.server import ServerOptions, VllmServer

pytestmark = pytest.mark.server

FLUSH_S = 1.0
GRID = 300.0  # gCO2e/kWh
MARKER = "zebra-quartz-prompt"  # a prompt's text, which must never reach the file


@pytest.fixture(scope="module")
def ledger_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ledger")


def options(tiny_model: Path, path: Path) -> ServerOptions:
    config = {"piep": {"ledger": str(path), "tenant_header": "X-Tenant-Id",
                       "ledger_flush_s": FLUSH_S, "carbon_intensity": GRID}}
    return ServerOptions(model=str(tiny_model), plugin="flag", max_model_len=LONG_TOKENS + 64,
                         extra_args=["--additional-config", json.dumps(config)])


@pytest.fixture(scope="module")
def server(tiny_model: Path, ledger_dir: Path) -> Iterator[VllmServer]:
    yield from serve(options(tiny_model, ledger_dir / "energy.db"), ledger_dir / "first")


def post(server: VllmServer, path: str, body: dict, tenant: str | None = None,
         client: httpx.Client | None = None) -> httpx.Response:
    headers = {} if tenant is None else {"X-Tenant-Id": tenant}
    body = {"model": "model", **body}
    if client is not None:
        return client.post(server.base_url + path, json=body, headers=headers, timeout=120)
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=120)


def summary(*args: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "vllm_piep.ledger", "summary", "--format",
                           "json", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_every_request_under_its_tenant_and_every_joule_once(server: VllmServer,
                                                             ledger_dir: Path) -> None:
    path = ledger_dir / "energy.db"
    completion = {"prompt": f"{MARKER} one", "max_tokens": 6, "ignore_eos": True}
    for _ in range(3):
        assert "energy" in post(server, "/v1/completions", completion, "acme").json()["usage"]
    for _ in range(2):
        post(server, "/v1/chat/completions", {"max_tokens": 4, "messages": [
            {"role": "user", "content": MARKER}]}, "globex").raise_for_status()
    # No header: the OpenAI `user` field names the tenant.
    post(server, "/v1/completions", {**completion, "user": "u-17"}).raise_for_status()
    # A header over 256 bytes is rejected, counted, and never stored; the `user` field does
    # not stand in for it.
    post(server, "/v1/completions", {**completion, "user": "u-17"}, "x" * 300
         ).raise_for_status()
    # A stream without a usage chunk (not_returned), two samples of one prompt, and a client
    # that leaves after the first token (aborted, or not_returned where vLLM finished it first).
    post(server, "/v1/completions", {**completion, "stream": True}, "acme").raise_for_status()
    post(server, "/v1/completions", {**completion, "n": 2, "temperature": 1.0}, "initech"
         ).raise_for_status()
    left = leave(server, {"model": "model", "prompt": "leaving", "max_tokens": LONG_TOKENS,
                          "ignore_eos": True}, headers={"X-Tenant-Id": "leaver"})
    left.check_booked()
    metrics = ledger_settled(server, path)

    outcomes = {r["outcome"]: r["joules"] for r in summary("--by", "outcome", str(path))
                if r["joules"]}  # (a request aborted before any energy has a 0 J row)
    counted = by_label(metrics, "piep_request_outcome_joules_total", "outcome")
    assert {k: v for k, v in counted.items() if v > 0}.keys() == outcomes.keys()
    for outcome, joules in outcomes.items():
        assert joules == pytest.approx(counted[outcome], rel=1e-9, abs=1e-12), outcome
    engine = value(metrics, "piep_engine_step_joules_total")
    assert sum(outcomes.values()) == pytest.approx(engine, rel=1e-9)
    assert outcomes.get("not_returned", 0.0) > 0  # the stream without a usage chunk

    tenants = {r["tenant"]: r for r in summary("--by", "tenant", str(path))}
    assert tenants["acme"]["requests"] == 4 and tenants["globex"]["requests"] == 2
    assert tenants["u-17"]["requests"] == 1 and tenants["initech"]["requests"] == 2
    assert tenants["acme"]["output_tokens"] == 4 * 6 and tenants["acme"]["prompt_tokens"] > 0
    assert tenants["acme"]["gco2e"] == pytest.approx(
        tenants["acme"]["joules"] / 3.6e6 * GRID, rel=1e-9)
    assert None in tenants  # the rejected header, the readiness probe, engine rows
    # The client that left: one request, under its tenant. Aborted: its energy booked to it at
    # the abort, and when the engine reported the abort (steps no output carried, as unsent; a
    # step already in flight, after its finish). Finished by vLLM before it saw the client go:
    # not returned.
    assert tenants["leaver"]["requests"] == 1 and tenants["leaver"]["joules"] > 0
    leaver = {r["outcome"]: r["joules"] for r in summary("--by", "tenant,outcome", str(path))
              if r["tenant"] == "leaver" and r["joules"]}
    if left.aborted:
        assert leaver.get("aborted", 0.0) > 0, leaver
        assert set(leaver) <= {"aborted", "unsent", "after_finish"}, leaver
    else:
        assert leaver.get("not_returned", 0.0) > 0, leaver
        assert set(leaver) <= {"not_returned", "after_finish"}, leaver
    assert value(metrics, "piep_ledger_tenants_rejected_total") == 1
    assert value(metrics, "piep_ledger_records_total", result="dropped") == 0
    written = value(metrics, "piep_ledger_records_total", result="written")
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM energy").fetchone()[0] == written
    raw = b"".join(p.read_bytes() for p in path.parent.glob("energy.db*"))
    assert MARKER.encode() not in raw and b"x" * 300 not in raw


def test_kill_9_under_load_loses_at_most_the_last_flush_and_a_restart_appends(
        server: VllmServer, tiny_model: Path, ledger_dir: Path) -> None:
    path = ledger_dir / "energy.db"
    answered: dict[str, float] = {}  # tenant -> when its response arrived (wall clock)
    stop = threading.Event()

    def client(worker: int) -> None:
        with httpx.Client() as http:
            for i in range(10_000):
                if stop.is_set():
                    return
                tenant = f"load-{worker}-{i}"
                try:
                    response = post(server, "/v1/completions",
                                    {"prompt": "load", "max_tokens": 4, "ignore_eos": True},
                                    tenant, http)
                except httpx.HTTPError:
                    return
                if response.status_code == 200:
                    answered[tenant] = time.time()

    def old_enough() -> int:
        """Responses answered earlier than the last flush interval (and a second for the
        commit and the scheduler): the ones the kill must not lose."""
        return sum(at < time.time() - FLUSH_S - 1.0 for at in dict(answered).values())

    with ThreadPoolExecutor(4) as pool:
        for worker in range(4):
            pool.submit(client, worker)
        poll(old_enough, lambda n: n > 10, "over ten responses older than a flush interval",
             every_s=0.2)
        assert server.pid is not None
        killed_at = time.time()
        os.kill(server.pid, signal.SIGKILL)
        stop.set()  # (a client in the middle of a request sees the server gone, and stops too)
    server.stop()  # the engine processes left behind

    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        stored = {row[0] for row in conn.execute(
            "SELECT tenant FROM energy WHERE tenant LIKE 'load-%'")}
        rows_before = conn.execute("SELECT count(*) FROM energy").fetchone()[0]
    before_kill = {t for t, at in answered.items() if at <= killed_at}
    # Everything answered earlier than the last flush interval (and a second for the commit
    # and the scheduler) is in the file; what is lost is at most that interval's rows.
    settled = {t for t in before_kill if answered[t] < killed_at - FLUSH_S - 1.0}
    assert len(settled) > 10, len(answered)
    assert settled <= stored, sorted(settled - stored)[:5]
    lost = before_kill - stored
    assert all(answered[t] >= killed_at - FLUSH_S - 1.0 for t in lost)
    print(f"kill -9 under load: {len(before_kill)} responses before the kill, {len(stored)} of "
          f"their requests in the file, {len(lost)} lost (answered within the last "
          f"{FLUSH_S + 1.0:.0f} s)")

    again = VllmServer(options(tiny_model, path), log_path=ledger_dir / "second" / "server.log")
    started = time.time()
    again.start()
    try:
        for _ in range(2):
            post(again, "/v1/completions", {"prompt": "after", "max_tokens": 3}, "after"
                 ).raise_for_status()
        ledger_settled(again, path, since=started)
    finally:
        again.stop()
    rows = {r["tenant"]: r for r in summary("--by", "tenant", str(path))}
    assert rows["after"]["requests"] == 2
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM energy").fetchone()[0] > rows_before
        assert conn.execute("SELECT count(DISTINCT writer) FROM energy").fetchone()[0] == 2
