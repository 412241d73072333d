"""The GPU user's process, run for real except for the device: vLLM's API server, engine core,
executor (in-process `uni`, the one-GPU default, and `mp` worker processes), async scheduling
with two steps in flight (`AsyncScheduler`, `EngineCore.step_with_batch_queue`) and OpenAI
serving code, over vLLM's own GPU `Worker` with a stand-in device and model runner
(`support/fake_gpu.py`: CUDA events on a simulated stream, V2-style async outputs).

Checked against what the stand-in GPU logged:
- every step is timed by the worker's CUDA events and the engine gets exactly that interval,
  through `AsyncModelRunnerOutput.get_output()` (V2) or a plain output (V1, sync scheduling);
- each response's energy, component by component, is its share of the steps it ran in as the
  prior predicts them from the logged batches and step times (static: the static power over
  the step, shared equally); a request that stopped on EOS while its next step was already
  scheduled has that step's share under `after_finish`, not lost and not on another request;
- Σ outcomes = piep_engine_step_joules_total to 1e-9;
- every text endpoint's response carries `usage.energy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

pytest.importorskip("vllm")

from support.fake_gpu import read_log  # noqa: E402
from support.metrics_text import by_label, total  # noqa: E402

from vllm_piep.model.components import COMPONENTS  # noqa: E402
from vllm_piep.model.devices import GPU_SPECS, DeviceProfile  # noqa: E402

PROFILE = "h100-sxm5-80gb"  # the engine core prices with this profile's static power
LAYOUTS = {
    # (executor, async scheduling, runner) -- a GPU user's default is the first
    "uni-async-v2": ("uni", True, "v2"),
    "mp-async-v2": ("mp", True, "v2"),
    "uni-sync-v1": ("uni", False, "v1-sync"),
    "mp-sync-v1": ("mp", False, "v1-sync"),
}


@contextlib.contextmanager
def played_stack(model: Path, layout: str, log: Path, env: dict[str, str] | None = None,
                 extra: list[str] | None = None):
    """An engine of this layout over the stand-in GPU: (run: a function running a coroutine
    against the client, the model's name, the GPU log's path, the layout, the registry)."""
    from prometheus_client import CollectorRegistry
    from support.fake_gpu_server import fake_gpu_server

    from vllm_piep.runtime import install
    from vllm_piep.runtime.api_server import outputs
    from vllm_piep.runtime.api_server.ledger import EnergyLedger
    from vllm_piep.runtime.api_server.metrics import EnergyMetrics

    backend, async_scheduling, runner = LAYOUTS[layout]
    env = {"PIEP_ENABLED": "1", "FAKE_GPU_LOG": str(log), "FAKE_GPU_RUNNER": runner,
           "PIEP_DEVICE_PROFILE": PROFILE, "HF_HUB_OFFLINE": "1", **(env or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    install.activate()
    registry = CollectorRegistry()
    outputs._ledger = EnergyLedger(EnergyMetrics(registry))
    loop = asyncio.new_event_loop()
    server = fake_gpu_server(model, backend=backend, async_scheduling=async_scheduling,
                             extra=extra)
    client, _engine = loop.run_until_complete(server.__aenter__())

    def run(make):
        return loop.run_until_complete(make(client))

    try:
        yield run, str(model), log, LAYOUTS[layout], registry
    finally:
        loop.run_until_complete(server.__aexit__(None, None, None))
        loop.close()
        outputs._ledger = None
        install.deactivate()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def stack(request, tiny_model: Path, tmp_path_factory):
    """One engine per layout, in prediction mode (no meter)."""
    log = tmp_path_factory.mktemp(request.param) / "gpu.jsonl"
    with played_stack(tiny_model, request.param, log) as stack:
        yield stack


def check_energy(energy: dict) -> None:
    assert energy["source"] == "prior" and energy["bundle"] == f"prior/{PROFILE}"
    assert math.fsum(energy["breakdown"].values()) == pytest.approx(energy["joules"], rel=1e-9)
    assert energy["prefill_joules"] + energy["decode_joules"] == pytest.approx(
        energy["joules"], rel=1e-9)
    assert energy["joules"] > 0


def _step_shares(steps: list[dict], model: Path) -> list[dict[str, np.ndarray]]:
    """Each logged step's split among its requests (request id -> joules per component), as
    the prior the engine serves predicts it: the same model shape (float32, one GPU) and
    profile, the step's scheduler numbers as the stand-in GPU logged them, its time as its
    CUDA events measured it; the split rule is the one the engine is held to."""
    from transformers import AutoConfig

    from vllm_piep.model.flops import ModelShape
    from vllm_piep.predict.prior import PriorPredictor

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model).to_dict(),
                                      dtype_bytes=4)
    rule = PriorPredictor(shape, DeviceProfile.from_spec(GPU_SPECS[PROFILE], 4)).split_rule()
    shares = []
    for step in steps:
        ids = list(step["batch"])
        start, n, outs, prompt = np.array([step["batch"][r] for r in ids], np.float64).T
        sched = np.vstack([start, n, outs, np.ones(len(ids))])
        requests, _ = rule.split(sched, prompt, (step["end"] - step["start"]) / 1e9)
        shares.append({r: requests[2:, i] for i, r in enumerate(ids)})
    return shares


def test_async_steps_land_on_the_requests_that_ran_in_them(stack) -> None:
    run, model, log, (_, async_scheduling, _), registry = stack
    prompts = [f"{'energy of a request ' * (i % 7 + 1)}#{i}" for i in range(12)]

    async def load(client):
        first = await asyncio.gather(*[client.post("/v1/completions", json={
            "model": model, "prompt": p, "max_tokens": 16}) for p in prompts])
        # One more request afterwards: its outputs carry the engine's totals that include the
        # steps scheduled after the others' EOS (an idle engine sends nothing).
        last = await client.post("/v1/completions", json={"model": model, "prompt": "last",
                                                          "max_tokens": 16})
        return [r.json() for r in first], last.json(), generate_latest(registry).decode()

    responses, last, metrics = run(load)
    steps = [s for s in read_log(log) if s["tokens"] > 0]
    shares = _step_shares(steps, Path(model))
    static = COMPONENTS.index("static")

    # What each response's energy must be, component by component: its share of every step it
    # ran in up to and including the one that sampled its EOS, each step timed by its CUDA
    # events; its share of the steps after that is the engine's after_finish energy.
    after_finish = 0.0
    for body in [*responses, last]:
        assert body["choices"][0]["finish_reason"] == "stop"
        energy = body["usage"]["energy"]
        check_energy(energy)
        mine = [(s, next(r for r in s["reqs"] if r.startswith(body["id"] + "-")), k)
                for k, s in enumerate(steps)
                if any(r.startswith(body["id"] + "-") for r in s["reqs"])]
        ended = next(i for i, (s, r, _) in enumerate(mine) if r in s["eos"])
        expected = [shares[k][r] for _, r, k in mine]
        ran = np.sum(expected[:ended + 1], axis=0)
        got = np.array([energy["breakdown"][c] for c in COMPONENTS])
        assert got == pytest.approx(ran, rel=1e-6, abs=1e-12)
        # The static share alone, from the profile's static power: the split rule's idle part
        # is what the step's time says.
        assert got[static] == pytest.approx(math.fsum(
            DeviceProfile.from_spec(GPU_SPECS[PROFILE], 4).static_watts
            * (s["end"] - s["start"]) / 1e9 / len(s["reqs"]) for s, _, _ in mine[:ended + 1]),
            rel=1e-6)
        later = math.fsum(float(x.sum()) for x in expected[ended + 1:])
        if body is last:  # its step after EOS may reach the counts before /metrics is read
            last_after_finish = later
        else:
            after_finish += later
        if not async_scheduling:
            assert len(mine) == ended + 1  # no step after its EOS

    outcomes = by_label(metrics, "piep_request_outcome_joules_total", "outcome")
    engine_total = total(metrics, "piep_engine_step_joules_total")
    assert math.fsum(outcomes.values()) == pytest.approx(engine_total, rel=1e-9)
    # With async scheduling a request that stops is already in the next step: that step's share
    # is after_finish energy, and only that (no abort, no unsent energy here).
    assert outcomes["aborted"] == outcomes["unsent"] == outcomes["incomplete"] == 0
    assert (after_finish > 0) == async_scheduling
    assert after_finish * (1 - 1e-9) <= outcomes["after_finish"] <= (
        after_finish + last_after_finish) * (1 + 1e-9)
    timers = by_label(metrics, "piep_engine_steps_total", "step_time")
    assert timers["engine_clock"] == 0 and timers["perf_counter"] == 0
    assert 0 < timers["cuda_event"] <= len(steps)


def _usage_energy(chunks: str, marker: str) -> dict:
    import json

    for line in chunks.splitlines():
        if line.startswith("data: {") and marker in line and '"energy"' in line:
            payload = json.loads(line[len("data: "):])
            usage = payload.get("usage") or payload.get("response", {}).get("usage")
            if usage and "energy" in usage:
                return usage["energy"]
    raise AssertionError(f"no usage.energy in the stream: {chunks[-800:]}")


def test_every_text_endpoint_carries_energy(stack) -> None:
    run, model, *_ = stack
    chat = [{"role": "user", "content": "How much energy does a token take?"}]
    stream = {"stream": True, "stream_options": {"include_usage": True}}

    async def calls(client):
        got = {}
        r = await client.post("/v1/completions", json={"model": model, "prompt": "a b c",
                                                       "max_tokens": 8})
        got["completions"] = r.json()["usage"]["energy"]
        r = await client.post("/v1/completions", json={"model": model, "prompt": "a b c",
                                                       "max_tokens": 8, **stream})
        got["completions stream"] = _usage_energy(r.text, '"usage"')
        r = await client.post("/v1/chat/completions", json={"model": model, "messages": chat,
                                                            "max_tokens": 8})
        got["chat"] = r.json()["usage"]["energy"]
        r = await client.post("/v1/chat/completions", json={"model": model, "messages": chat,
                                                            "max_tokens": 8, **stream})
        got["chat stream"] = _usage_energy(r.text, '"usage"')
        r = await client.post("/v1/chat/completions/batch", json={
            "model": model, "messages": [chat, chat[:1]], "max_tokens": 8})
        got["batch chat"] = r.json()["usage"]["energy"]
        r = await client.post("/v1/responses", json={"model": model, "input": "Hi there",
                                                     "max_output_tokens": 8})
        got["responses"] = r.json()["usage"]["energy"]
        r = await client.post("/v1/responses", json={"model": model, "input": "Hi there",
                                                     "max_output_tokens": 8, "stream": True})
        got["responses stream"] = _usage_energy(r.text, '"response.')
        r = await client.post("/v1/messages", json={"model": model, "messages": chat,
                                                    "max_tokens": 8})
        got["messages"] = r.json()["usage"]["energy"]
        r = await client.post("/v1/messages", json={"model": model, "messages": chat,
                                                    "max_tokens": 8, "stream": True})
        got["messages stream"] = _usage_energy(r.text, '"message_delta"')
        return got

    got = run(calls)
    assert set(got) == {"completions", "completions stream", "chat", "chat stream",
                        "batch chat", "responses", "responses stream", "messages",
                        "messages stream"}
    for endpoint, energy in got.items():
        try:
            check_energy(energy)
        except AssertionError as exc:
            raise AssertionError(f"{endpoint}: {exc}") from exc


MEASURED = ("uni-async-v2", "mp-async-v2")  # the GPU default, in-process and multiprocess


@pytest.fixture(scope="module", params=MEASURED, ids=[f"{m}-measured" for m in MEASURED])
def measured_stack(request, tiny_model: Path, tmp_path_factory):
    """A GPU default engine in measured mode, as a GPU user gets it with no option: the engine
    core's default meter is NVML, here the stand-in `pynvml` (support/standin_pynvml: 80 W,
    counter updated every 40 ms), with a KV cache small enough that requests are preempted."""
    from support.paths import SUPPORT

    out = tmp_path_factory.mktemp(f"{request.param}-measured")
    path = [str(SUPPORT / "standin_pynvml"), str(SUPPORT),
            *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {"PYTHONPATH": os.pathsep.join(path), "STANDIN_LOG": str(out / "readings.csv"),
           "STANDIN_FREEZE": str(out / "freeze")}
    # The engine core process finds the stand-in at the `pynvml` seam whether it is spawned
    # (multiprocessing hands it this process's sys.path) or forked (sys.modules).
    saved_module, saved_path = sys.modules.get("pynvml"), list(sys.path)
    sys.path[:0] = path[:2]
    spec = importlib.util.spec_from_file_location("pynvml",
                                                  SUPPORT / "standin_pynvml" / "pynvml.py")
    sys.modules["pynvml"] = standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    try:
        with played_stack(tiny_model, request.param, out / "gpu.jsonl", env,
                          ["--block-size", "16", "--num-gpu-blocks-override", "20"]) as stack:
            yield stack, out
    finally:
        sys.path[:] = saved_path
        if saved_module is None:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = saved_module


def test_measured_mode_on_the_gpu_default_path(measured_stack) -> None:
    """Every response measured by the meter, none by the fit; Σ outcomes = the engine's
    measured steps; steps + idle = the counter's delta; preemption and a request's step after
    its EOS accounted as in prediction mode."""
    (run, model, log, (_, async_scheduling, _), registry), out = measured_stack
    prompts = [f"{'energy of a request ' * (i % 7 + 1)}#{i}" for i in range(12)]
    # Half run to 48 tokens, more than the KV cache holds for all (preemption); half stop on
    # the stand-in's EOS after a few (with async scheduling, in a step already scheduled).
    bodies = [{"model": model, "prompt": p, "max_tokens": 48, "ignore_eos": True} if i % 2
              else {"model": model, "prompt": p, "max_tokens": 16}
              for i, p in enumerate(prompts)]

    async def load(client):
        readings = out / "readings.csv"
        for _ in range(100):  # the engine's meter thread opens the meter in ~0.5 s: its first
            if readings.exists():  # reading is the base of every step after it
                break
            await asyncio.sleep(0.1)
        first = await asyncio.gather(*[client.post("/v1/completions", json=b)
                                       for b in bodies])
        last = await client.post("/v1/completions", json={"model": model, "prompt": "last",
                                                          "max_tokens": 16})
        return [r.json() for r in [*first, last]]

    responses = run(load)
    for body in responses:
        energy = body["usage"]["energy"]
        assert (energy["source"], energy["meter"]) == ("measured", "nvml"), energy
        assert math.fsum(energy["breakdown"].values()) == pytest.approx(energy["joules"],
                                                                        rel=1e-9)
        assert energy["joules"] > 0 and energy["predicted_joules"] > 0
    steps = read_log(log)
    assert any(s["resumed"] for s in steps), "no request was preempted"

    (out / "freeze").touch()  # the counter stops: its last value is the last one split
    run(lambda _client: asyncio.sleep(3.0))  # > the idle engine's once-a-second report
    metrics = generate_latest(registry).decode()
    outcomes = by_label(metrics, "piep_request_outcome_joules_total", "outcome")
    step = total(metrics, "piep_engine_step_joules_total")
    assert total(metrics, "piep_meter_fitted_joules_total") == 0
    assert total(metrics, "piep_meter_fallback_steps_total") == 0
    assert math.fsum(outcomes.values()) == pytest.approx(step, rel=1e-9)
    returned = math.fsum(b["usage"]["energy"]["joules"] for b in responses)
    assert outcomes["finished"] == pytest.approx(returned, rel=1e-9)
    # With async scheduling a request that stopped on EOS ran in one more step: that step's
    # energy is in its response (its output waited for the meter to settle it) or, had the
    # output gone before, after_finish; nothing is lost or aborted.
    ended = {r for s in steps for r in s["eos"]}
    after_eos = [r for i, s in enumerate(steps) for r in s["reqs"]
                 if r in ended and any(r in t["eos"] for t in steps[:i])]
    assert bool(after_eos) == async_scheduling
    assert outcomes["aborted"] == outcomes["unsent"] == outcomes["incomplete"] == 0
    assert outcomes["finished"] + outcomes["after_finish"] + outcomes["warmup"] == \
        pytest.approx(step, rel=1e-9)
    rows = [line.split(",") for line in (out / "readings.csv").read_text().splitlines()]
    assert len({pid for pid, _, _ in rows}) == 1  # the engine core's meter, only
    counter_delta = (int(rows[-1][2]) - int(rows[0][2])) / 1000
    idle = total(metrics, "piep_idle_joules_total")
    assert step + idle == pytest.approx(counter_delta, rel=1e-9), (step, idle, counter_delta)
