"""Load on a real `vllm serve --plugins piep` with the calibrated tiny-model bundle: 500 mixed
requests at 64 concurrent, with clients that disconnect
mid-stream or cancel before their first token. Afterwards the server still answers, the
plugin's per-request state drains to nothing, energy is conserved across /metrics, and every
response that carried usage carries a self-consistent usage.energy."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support import loadgen
from support.metrics_text import by_label, total
from support.quiet import poll, wait_until_quiet
from support.servers import serve

from vllm_piep.runtime.api_server.metrics import OUTCOMES
from vllm_piep.tools.server import ServerOptions, VllmServer

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

REQUESTS = 500
CONCURRENCY = 64
SEED = 20240607
TRACKED = "piep_tracked_requests"
ENGINE_TRACKED = "piep_engine_tracked_requests"
WHERE = ("api_open", "api_closed", "api_recent")
REL = 1e-9


@dataclass(frozen=True)
class LoadRun:
    results: list[loadgen.Result] = field(repr=False)
    before: str = field(repr=False)  # /metrics before the load
    after: str = field(repr=False)  # /metrics after the load, the final request and settling
    final: dict[str, Any]  # a plain completion sent once the load was over
    tracked: dict[str, float]  # piep_tracked_requests by `where`, when `after` was read
    load_s: float
    log: str = field(repr=False)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    config = {"piep": {"bundle": "auto"}}
    yield from serve(ServerOptions(model=str(tiny_model),
                                   extra_args=["--additional-config", json.dumps(config)]),
                     tmp_path_factory.mktemp("serve_load"))


def _tracked(text: str) -> dict[str, float]:
    """API servers' state by place, and the engines' (summed) as `engine`."""
    engines = by_label(text, ENGINE_TRACKED, "engine")
    return {**by_label(text, TRACKED, "where"),
            **({"engine": sum(engines.values())} if engines else {})}


@pytest.fixture(scope="module")
def load(server: VllmServer) -> LoadRun:
    before = server.get_text("/metrics")
    start = time.monotonic()
    results = asyncio.run(loadgen.run(server.base_url, loadgen.plan(REQUESTS, SEED),
                                      CONCURRENCY))
    load_s = time.monotonic() - start
    # The engine reports its count with each step: one more request after the load makes it
    # report the state the load left behind.
    final = server.post("/v1/completions", {"model": "model", "prompt": "def f(x):",
                                            "max_tokens": 4, "ignore_eos": True})
    # Drained and settled; if it never is, test_per_request_state_drains says what is left.
    after, _ = wait_until_quiet(server)
    print(f"\nload: {REQUESTS} requests at {CONCURRENCY} concurrent in {load_s:.1f} s")
    return LoadRun(results, before, after, final, _tracked(after), load_s,
                   server.log_path.read_text(errors="replace"))


def _received_usages(run: LoadRun) -> list[dict[str, Any]]:
    """Usage of every response received in full: non-streaming ones, streams with
    include_usage that ended with [DONE], and the final request."""
    usages = [r.usage for r in run.results if r.complete and r.usage is not None]
    return [*usages, run.final["usage"]]


def test_the_workload_is_the_planned_mix(load: LoadRun) -> None:
    """Guards the other tests: each kind of client behaviour really happened."""
    def count(**want: Any) -> int:
        return sum(all(getattr(r.planned, k) == v for k, v in want.items())
                   for r in load.results)

    assert count(action="disconnect") >= 30
    assert count(action="cancel") >= 30
    assert count(action="read", stream=True, include_usage=False) >= 50
    assert count(action="read", stream=True, include_usage=True) >= 50
    assert count(action="read", stream=False) >= 100
    assert sum(r.planned.body.get("n") == 2 for r in load.results) >= 5
    assert sum("stop" in r.planned.body for r in load.results) >= 5
    dropped = 0
    for r in load.results:
        if r.planned.action == "disconnect":
            # Dropped mid-stream after the planned number of content chunks; or, where vLLM's
            # API server merged the deltas of a client that read late, the whole answer came in
            # fewer chunks and the stream ended before the planned drop.
            if r.complete:
                assert r.content_chunks < r.planned.disconnect_after, str(r)
            else:
                assert r.content_chunks == r.planned.disconnect_after, str(r)
                dropped += 1
    assert dropped > 0  # clients did leave mid-stream


def test_no_server_errors(load: LoadRun) -> None:
    for r in load.results:
        assert r.error is None, str(r)
        if r.planned.action != "cancel":
            assert r.status == 200, str(r)
        if r.planned.action == "read":
            assert r.complete, str(r)
    # Also what the clients did not wait for (cancelled and dropped requests): the access log.
    assert not re.findall(r'"(?:POST|GET) [^"]*" 5\d\d', load.log)
    # No failure caught at the plugin's boundary: a fault-free load must not need one.
    assert not [line for line in load.log.splitlines()
                if "vllm_piep:" in line and " failed (" in line]


def test_server_still_answers_with_energy(load: LoadRun) -> None:
    usage = load.final["usage"]
    assert load.final["choices"] and usage["completion_tokens"] == 4
    # the shipped bundle (made on a CPU estimate, so it says so), not the prior
    assert usage["energy"]["source"] == "estimated"
    assert usage["energy"]["joules"] > 0


def test_every_usage_carries_consistent_energy(load: LoadRun) -> None:
    usages = _received_usages(load)
    streamed = [r for r in load.results if r.complete and r.planned.include_usage]
    assert streamed and all(r.usage is not None for r in streamed), [
        str(r) for r in streamed if r.usage is None]
    for usage in usages:
        energy = usage.get("energy")
        assert energy is not None, usage
        assert energy["source"] == "estimated"
        assert math.isfinite(energy["joules"]) and energy["joules"] > 0, energy
        assert math.fsum(energy["breakdown"].values()) == pytest.approx(energy["joules"],
                                                                        rel=REL)
        assert energy["prefill_joules"] + energy["decode_joules"] == pytest.approx(
            energy["joules"], rel=REL)
    # Streams without include_usage get no usage chunk at all.
    assert not [r for r in load.results if r.planned.stream and not r.planned.include_usage
                and r.usage is not None]


def test_per_request_state_drains(server: VllmServer, load: LoadRun) -> None:
    """Nothing per request is left once the load is over: not in the engine, nor among the
    API server's open or closed (never taken) records once it is quiet, nor among its recently
    finished ones once their hold for late outputs (a few seconds) has passed."""
    places = (*WHERE, "engine")
    assert set(places) <= set(load.tracked), f"{TRACKED} lacks some of {places}: {load.tracked}"
    held = [where for where in places if where != "api_recent"]
    assert {where: load.tracked[where] for where in held} == dict.fromkeys(held, 0.0)
    poll(lambda: _tracked(server.get_text("/metrics")),
         lambda tracked: all(tracked.get(where, 0.0) == 0.0 for where in places),
         "every recently finished record dropped")


def test_energy_is_conserved(load: LoadRun) -> None:
    def delta(name: str) -> float:
        return total(load.after, name) - total(load.before, name)

    def delta_by(name: str, label: str) -> dict[str, float]:
        before, after = by_label(load.before, name, label), by_label(load.after, name, label)
        return {k: v - before.get(k, 0.0) for k, v in after.items()}

    engine = delta("piep_engine_step_joules_total")
    by_source = delta("piep_energy_joules_total")
    outcomes = delta_by("piep_request_outcome_joules_total", "outcome")
    seen = {"engine": engine, "sources": by_source, **outcomes}
    assert engine > 0
    assert by_source == pytest.approx(engine, rel=REL), seen
    assert set(outcomes) <= set(OUTCOMES), outcomes
    assert math.fsum(outcomes.values()) == pytest.approx(engine, rel=REL), seen
    # Streams dropped after a content chunk had done their prefill: their energy is aborted.
    assert outcomes.get("aborted", 0.0) > 0, outcomes
    # What the clients were told is what finished, less, rarely, a response that went out
    # to a client that had just dropped. Streams without include_usage that ended normally
    # finished with energy no client saw: `not_returned`.
    told = math.fsum(u["energy"]["joules"] for u in _received_usages(load))
    finished = outcomes.get("finished", 0.0)
    unseen = [r for r in load.results
              if r.complete and r.planned.stream and not r.planned.include_usage]
    assert unseen and outcomes.get("not_returned", 0.0) > 0, outcomes
    assert told <= finished * (1 + REL), (told, finished)
