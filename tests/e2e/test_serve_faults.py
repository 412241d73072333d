"""A predictor and a serve-time meter that raise inside one real server: every response still
goes out (without usage.energy, since the predictor fails), each failure is logged once, with
its own line, and shows on /metrics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.metrics_text import samples, value
from support.quiet import poll
from support.servers import engine_pids, serve, support_env

from vllm_piep.tools.server import ServerOptions, VllmServer

pytestmark = pytest.mark.server
READS = "meter_reads"  # beside the server's log: a line per read of its meter, the reader's pid


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    out = tmp_path_factory.mktemp("faults")
    env = support_env(PIEP_PREDICTOR="piep_test_predictors:raising",
                      PIEP_METER="logged_raising_meter:raising_read",
                      RAISING_LOG=str(out / READS))
    yield from serve(ServerOptions(model=str(tiny_model), plugin="flag", extra_env=env), out)


def test_failing_predictor_never_breaks_serving(server: VllmServer) -> None:
    before = server.get_text("/metrics")
    responses = [
        server.post("/v1/completions", {"model": "model", "prompt": "x", "max_tokens": 5,
                                        "ignore_eos": True}),
        server.post("/v1/chat/completions", {"model": "model", "max_tokens": 5,
                                             "messages": [{"role": "user", "content": "y"}]}),
        server.post("/v1/completions", {"model": "model", "prompt": ["a", "b"], "n": 2,
                                        "temperature": 1.0, "max_tokens": 3}),
    ]
    after = server.get_text("/metrics")
    for response in responses:
        assert response["choices"] and "energy" not in response["usage"]
    # One failed prediction per engine step: at least one per generated token of the first.
    errors = value(after, "piep_predictor_errors_total") - value(before,
                                                                 "piep_predictor_errors_total")
    assert errors >= 5
    assert value(after, "piep_requests_unattributed_total") - value(
        before, "piep_requests_unattributed_total") == 1 + 1 + 4
    assert value(after, "piep_energy_joules_total", source="prior") == 0
    log = server.log_path.read_text()
    assert log.count("vllm_piep: predicting a step's energy failed (RuntimeError: injected "
                     "predictor failure)") == 1


def _meter_lines(server: VllmServer) -> list[str]:
    return [line for line in server.log_path.read_text(errors="replace").splitlines()
            if "vllm_piep:" in line and "injected meter read failure" in line]


def test_failing_meter_never_breaks_serving(server: VllmServer) -> None:
    response = server.post("/v1/completions", {"model": "model", "prompt": "z", "max_tokens": 4,
                                               "ignore_eos": True})
    assert response["choices"]
    # The API server samples the meter on a thread from startup on, retrying with a back-off;
    # the engine core reads it when it starts. Wait until the API server's reads have failed
    # three times (each failure handled before the next read) and the engine's once, and both
    # have said so in the log.
    def failed() -> dict[str, int]:
        log = server.log_path.parent / READS
        pids = Counter(int(pid) for pid in log.read_text().split()) if log.exists() else {}
        engines = engine_pids(server)
        lines = _meter_lines(server)
        return {"api_reads": pids.get(server.pid, 0),
                "engine_reads": sum(n for pid, n in pids.items() if pid in engines),
                "api_lines": sum("EngineCore" not in line for line in lines),
                "engine_lines": sum("EngineCore" in line for line in lines)}

    poll(failed, lambda seen: seen["api_reads"] >= 3 and seen["engine_reads"] >= 1
         and seen["api_lines"] >= 1 and seen["engine_lines"] >= 1,
         "the meter's reads failing in the API server and the engine core")
    lines = _meter_lines(server)
    # One line per process that reads it: the API server's sampler, and the engine core,
    # which then stays in prediction mode.
    api = [line for line in lines if "EngineCore" not in line]
    engine = [line for line in lines if "EngineCore" in line]
    assert len(api) == 1 and len(engine) == 1, lines
    assert "WARNING" in api[0] and "meter" in api[0] and "raising-read" in api[0]
    assert "measured energy" in engine[0] and "model's prediction" in engine[0]
    text = server.get_text("/metrics")
    assert ("piep_meter_up", ()) in samples(text)
    assert value(text, "piep_meter_up") == 0
