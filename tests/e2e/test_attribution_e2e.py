"""Attribution on a real server, where vLLM's scheduler makes it hard: prompts chunked over
several steps, prefix-cache hits, preemption and recompute under a small KV cache, stop
strings found by the API server, a client that leaves mid-stream. Every response's energy
adds up, and once the server is idle /metrics accounts for every joule the engine predicted.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.metrics_text import by_label, total, value
from support.quiet import quiet_metrics
from support.servers import leave, serve

from vllm_piep.tools.server import ServerOptions, VllmServer

pytestmark = pytest.mark.server

BATCH_TOKENS = 64  # tokens per step: a longer prompt is prefilled in chunks
GRID = 420.0  # gCO2e/kWh
BLOCKS = 24  # KV cache blocks of 32 tokens (the CPU backend's unit): 768 tokens in all


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    options = ServerOptions(
        model=str(tiny_model), plugin="flag",
        extra_args=["--additional-config",
                    json.dumps({"piep": {"bundle": "auto", "carbon_intensity": GRID}}),
                    "--enable-chunked-prefill", "--max-num-batched-tokens", str(BATCH_TOKENS),
                    "--enable-prefix-caching", "--block-size", "32",
                    "--num-gpu-blocks-override", str(BLOCKS),
                    "--enable-prompt-tokens-details"])
    yield from serve(options, tmp_path_factory.mktemp("attribution"))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def complete(server: VllmServer, **body: Any) -> dict[str, Any]:
    return server.post("/v1/completions", {"model": "model", "temperature": 0, **body})


def energy_of(response: dict[str, Any]) -> dict[str, Any]:
    energy = response["usage"]["energy"]
    assert energy["source"] == "estimated"  # the shipped bundle, made on a CPU estimate
    assert sum(energy["breakdown"].values()) == pytest.approx(energy["joules"], rel=1e-9)
    assert energy["prefill_joules"] + energy["decode_joules"] == pytest.approx(
        energy["joules"], rel=1e-9)
    lo, hi = energy["interval"]  # the shipped bundle has a split-conformal interval
    assert lo < energy["joules"] < hi and energy["interval_level"] == 0.9
    assert energy["gco2e"] == pytest.approx(energy["joules"] / 3.6e6 * GRID, rel=1e-12)
    return energy


def test_a_prompt_prefilled_in_chunks_pays_for_all_of_it(server: VllmServer) -> None:
    """Alone on the server, a prompt three step budgets long: its energy is every joule the
    engine predicted meanwhile, over the chunk steps (which produce no output) and the
    decode steps."""
    before = server.get_text("/metrics")
    response = complete(server, prompt=tokens(3 * BATCH_TOKENS, 2), max_tokens=2)
    after = server.get_text("/metrics")
    # (vLLM's own step counters skip the chunk steps: they send no output. The token budget
    # of the server makes three of them.)
    engine = (value(after, "piep_engine_step_joules_total")
              - value(before, "piep_engine_step_joules_total"))
    energy = energy_of(response)
    assert energy["joules"] == pytest.approx(engine, rel=1e-9)
    assert energy["prefill_joules"] > energy["decode_joules"] > 0


def test_a_prefix_cache_hit_costs_no_prefill_for_the_cached_tokens(server: VllmServer) -> None:
    prompt = tokens(160, 3)
    first = complete(server, prompt=prompt, max_tokens=2)
    second = complete(server, prompt=prompt, max_tokens=2)
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached >= 128, second["usage"]  # the scenario happened
    # 160 tokens computed cold, at most 32 warm.
    assert energy_of(second)["prefill_joules"] < 0.5 * energy_of(first)["prefill_joules"]


def test_stop_strings_found_by_the_api_server(server: VllmServer) -> None:
    prompt = tokens(12, 4)
    full = complete(server, prompt=prompt, max_tokens=32, ignore_eos=True)
    text = full["choices"][0]["text"]
    stop = next((text[i:i + 3] for i in range(len(text) // 3, len(text) - 3)
                 if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i), None)
    if stop is None:
        pytest.skip(f"no usable stop string in {text!r}")
    cut = complete(server, prompt=prompt, max_tokens=32, ignore_eos=True, stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] < full["usage"]["completion_tokens"]
    assert 0 < energy_of(cut)["joules"] < energy_of(full)["joules"]


def test_preemption_and_recompute_under_a_small_kv_cache(server: VllmServer) -> None:
    """Twelve prompts growing to 198 tokens each, three times the 768 the KV cache holds, in
    one request: vLLM adds all twelve to the engine at once, so they compete for the cache and
    some are preempted and recomputed (twelve clients' requests can arrive one after another on
    a loaded machine, each done before the next comes, and never compete)."""
    before = server.get_text("/metrics")
    response = complete(server, prompt=[tokens(48, 10 + i) for i in range(12)],
                        max_tokens=150, ignore_eos=True)
    after = server.get_text("/metrics")
    preempted = (total(after, "vllm:num_preemptions_total")
                 - total(before, "vllm:num_preemptions_total"))
    assert preempted > 0
    assert len(response["choices"]) == 12 and response["usage"]["completion_tokens"] == 12 * 150
    assert energy_of(response)["joules"] > 0


def test_a_client_leaving_mid_stream(server: VllmServer) -> None:
    # The connection is closed: vLLM aborts the request, its energy counted as aborted; or,
    # where vLLM generated every token before it saw the client go, as not returned.
    leave(server, {"model": "model", "prompt": tokens(20, 5), "max_tokens": 200,
                   "ignore_eos": True}).check_booked()


def test_metrics_account_for_every_predicted_joule(server: VllmServer) -> None:
    """Runs last: with the server idle, the engine's predicted total is split exactly into
    the outcomes, and no request is left in the plugin's state."""
    complete(server, prompt=tokens(8, 6), max_tokens=2)
    text = quiet_metrics(server)
    engine = value(text, "piep_engine_step_joules_total")
    by_source = total(text, "piep_energy_joules_total")
    outcomes = by_label(text, "piep_request_outcome_joules_total", "outcome")
    assert engine > 0
    assert by_source == pytest.approx(engine, rel=1e-9)
    assert sum(outcomes.values()) == pytest.approx(engine, rel=1e-9)
