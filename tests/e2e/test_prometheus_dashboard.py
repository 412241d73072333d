"""The Grafana dashboard's queries, evaluated by a real Prometheus (`support/prometheus.py`: the
Debian package's 2.42, unpacked by scripts/setup.sh) scraping a real `vllm serve --plugins piep`
with two API server processes, after mixed traffic (completions, chat, streams, n = 2, a client
that leaves mid-stream). Every query of `dashboards/grafana.json`, its variables substituted as
Grafana would, evaluates without error and returns data; the finished energy Prometheus holds
equals the sum of the responses' `usage.energy.joules`, exactly between two scrapes and within
`increase()`'s extrapolation over a window.

The server measures with the CPU estimate and has a grid intensity, so that the dashboard's
measured-mode and emissions panels have series too. It keeps a billing ledger, one file for both
API server processes, whose rows hold every joule /metrics counts, once."""

from __future__ import annotations

import json
import math
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.grafana import dashboard
from support.metrics_text import by_label, value
from support.prometheus import Prometheus, prometheus_binary
from support.quiet import ledger_settled, poll, quiet_metrics
from support.servers import leave_after_first_chunk, serve

from vllm_piep.tools.server import ServerOptions, VllmServer

pytestmark = pytest.mark.server
SCRAPE_S = 1.0
RATE_INTERVAL = "15s"  # Grafana's $__rate_interval at a 1 s scrape interval, rounded up
RANGE = "10m"  # the dashboard's time range ($__range)


@pytest.fixture(scope="module")
def scraped(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[VllmServer, Prometheus]]:
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("no prometheus: `apt-get install prometheus`, or rerun scripts/setup.sh "
                    "(it unpacks Debian's package under .cache/prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = {"piep": {"meter": "cpu-estimate", "carbon_intensity": 400.0,
                       "ledger": str(tmp / "energy.db")}}
    options = ServerOptions(model=str(tiny_model), plugin="flag",
                            extra_args=("--api-server-count", "2",
                                        "--additional-config", json.dumps(config)))
    for server in serve(options, tmp):
        prometheus = Prometheus(binary, [server.base_url.removeprefix("http://")], tmp / "prom",
                                SCRAPE_S)
        try:
            yield server, prometheus
        finally:
            prometheus.stop()


def scalar(prometheus: Prometheus, expr: str, at: float) -> float:
    answer = prometheus.query(expr, at)
    assert answer["status"] == "success", (expr, answer)
    result = answer["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def wait_for_scrape(server: VllmServer, prometheus: Prometheus) -> float:
    """A time just after a scrape of the server once quiet (`quiet_metrics`)."""
    quiet_metrics(server)
    seen = prometheus.scrapes()
    poll(prometheus.scrapes, lambda scrapes: scrapes >= seen + 2, "two more scrapes",
         every_s=0.2)
    return time.time()


def test_every_dashboard_query_returns_data_and_the_energy_agrees(scraped: tuple) -> None:
    server, prometheus = scraped
    finished_before = "sum(piep_request_outcome_joules_total{outcome=\"finished\"})"
    t0 = wait_for_scrape(server, prometheus)
    before = scalar(prometheus, finished_before, t0)

    def energy(path: str, body: dict) -> float:
        if body.get("stream"):
            text = server.post_text(path, body)
            usage = [json.loads(line[6:])["usage"] for line in text.splitlines()
                     if line.startswith("data: {") and '"usage"' in line][-1]
            return float(usage["energy"]["joules"])
        return float(server.post(path, body)["usage"]["energy"]["joules"])

    chat = [{"role": "user", "content": "hello"}]
    bodies = [("/v1/completions", {"model": "model", "prompt": f"n = {i}", "max_tokens": 4 + i,
                                   "ignore_eos": True}) for i in range(6)]
    bodies += [("/v1/chat/completions", {"model": "model", "messages": chat, "max_tokens": 5,
                                         "ignore_eos": True, "n": 2, "temperature": 1.0})]
    bodies += [("/v1/completions", {"model": "model", "prompt": "s = ", "max_tokens": 6,
                                    "ignore_eos": True, "stream": True,
                                    "stream_options": {"include_usage": True}})] * 2
    bodies += [("/v1/chat/completions", {"model": "model", "messages": chat, "max_tokens": 4,
                                         "ignore_eos": True, "stream": True,
                                         "stream_options": {"include_usage": True}})]
    with ThreadPoolExecutor(4) as pool:
        returned = list(pool.map(lambda pb: energy(*pb), bodies))
    leave_after_first_chunk(server, {"model": "model", "prompt": "gone", "max_tokens": 64,
                                     "ignore_eos": True})
    t1 = wait_for_scrape(server, prometheus)

    # Exact: the counter's values at two scrapes around the traffic.
    after = scalar(prometheus, finished_before, t1)
    assert after - before == pytest.approx(math.fsum(returned), rel=1e-9)
    # increase() over the window extrapolates the first and last samples in it to its ends:
    # with a sample every SCRAPE_S, it is off by at most 2 * SCRAPE_S over the window.
    window = math.ceil(t1 - t0) + 2
    increased = scalar(prometheus, f"sum(increase(piep_request_outcome_joules_total"
                                   f"{{outcome=\"finished\"}}[{window}s] @ {t1:.3f}))", t1)
    bound = 2 * SCRAPE_S / (window - 2 * SCRAPE_S)
    assert increased == pytest.approx(math.fsum(returned), rel=bound), (increased, bound)

    # The dashboard: its instance variable, then every panel's queries with it substituted.
    [instance_variable] = [v for v in dashboard()["templating"]["list"] if v["name"] ==
                           "instance"]
    metric, label = instance_variable["definition"].removeprefix("label_values(").rstrip(
        ")").split(", ")
    answer = prometheus.query(f"group by ({label}) ({metric})", t1)
    instances = [r["metric"][label] for r in answer["data"]["result"]]
    assert instances == [server.base_url.removeprefix("http://")], answer
    escaped = instances[0].replace(".", "\\\\.")
    empty, failed = [], []
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = (target["expr"].replace("$instance", escaped)
                    .replace("$__rate_interval", RATE_INTERVAL).replace("$__range", RANGE))
            answer = prometheus.query(expr, t1)
            if answer.get("status") != "success":
                failed.append((panel["title"], expr, answer.get("error")))
            elif not answer["data"]["result"]:
                empty.append((panel["title"], expr))
    assert not failed, failed
    assert not empty, empty


def test_the_ledger_of_two_api_servers_holds_every_joule_once(scraped: tuple) -> None:
    """After the traffic above: the rows of both API server processes, in one file, sum by
    outcome to /metrics' outcome counters (summed over the processes) and to the engine's step
    energy; measured idle energy, which accrues while the server waits, lies between two reads
    of /metrics around the ledger's."""
    server, _ = scraped
    path = next(Path(server.log_path.parent).glob("energy.db"))
    first = quiet_metrics(server)
    ledger_settled(server, path)  # every row counted before `first` is committed
    done = subprocess.run([sys.executable, "-m", "vllm_piep.ledger", "summary", "--by",
                           "outcome", "--format", "json", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {r["outcome"]: r["joules"] for r in json.loads(done.stdout) if r["joules"]}
    second = server.get_text("/metrics")
    counted = by_label(second, "piep_request_outcome_joules_total", "outcome")
    idle = rows.pop("idle", 0.0)
    assert rows == pytest.approx({k: v for k, v in counted.items() if v > 0}, rel=1e-9), (
        rows, counted)
    assert math.fsum(rows.values()) == pytest.approx(
        value(second, "piep_engine_step_joules_total"), rel=1e-9)
    assert value(first, "piep_idle_joules_total") <= idle * (1 + 1e-9)
    assert idle <= value(second, "piep_idle_joules_total") * (1 + 1e-9)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
