"""Disaggregated prefill and decode on two real `vllm serve` instances (with vLLM's
per-request metrics, which carry the energy too): vLLM's example KV
connector (`ExampleConnector`: each layer's KV in files both instances share) moves the
prompt's KV, and a proxy in this test does what vLLM's disaggregated-serving proxy example does
(the prefill request with `do_remote_decode` and one token, its response's `kv_transfer_params`
copied into the decode request, one X-Request-Id for both). The decode response carries the
whole request's energy, each instance's part listed; each instance books only its own joules;
a part a client forges is dropped."""

from __future__ import annotations

import json
import math
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from support.metrics_text import by_label, total
from support.quiet import quiet_metrics
from support.servers import serve

from vllm_piep.peer_energy import PART_KEY
from vllm_piep.tools.server import ServerOptions, VllmServer

pytestmark = pytest.mark.server

KEY = "a peer key both instances are given"
PROMPT = "The energy of a request served on two machines is"


class Fleet(NamedTuple):
    prefill: VllmServer
    decode: VllmServer
    storage: Path


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    storage = tmp_path_factory.mktemp("kv")
    kv = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": str(storage)}})

    def options() -> ServerOptions:
        return ServerOptions(model=str(tiny_model),
                             extra_args=("--kv-transfer-config", kv,
                                         "--enable-per-request-metrics"),
                             extra_env={"PIEP_PEER_KEY": KEY})

    logs = tmp_path_factory.mktemp("fleet")
    starts = [serve(options(), logs / role) for role in ("prefill", "decode")]
    with ThreadPoolExecutor(2) as pool:  # two starts at once: mostly one core each
        prefill, decode = pool.map(next, starts)
    try:
        yield Fleet(prefill, decode, storage)
    finally:
        for start in starts:
            start.close()


def post(server: VllmServer, path: str, body: dict[str, Any], request_id: str) -> str:
    req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Id": request_id})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read().decode()


def proxy(fleet: Fleet, path: str, body: dict[str, Any]) -> tuple[dict, str]:
    """What vLLM's disaggregated proxy example does: (the prefill's response, the decode
    instance's response body)."""
    request_id = str(uuid.uuid4())
    prefill_body = {**body, "max_tokens": 1, "stream": False,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                           "remote_engine_id": None, "remote_block_ids": None,
                                           "remote_host": None, "remote_port": None}}
    prefill_body.pop("stream_options", None)
    prefilled = json.loads(post(fleet.prefill, path, prefill_body, request_id))
    decode_body = {**body, "kv_transfer_params": prefilled.get("kv_transfer_params")}
    return prefilled, post(fleet.decode, path, decode_body, request_id)


def final_usage(stream: str) -> dict:
    events = [json.loads(line[len("data: "):]) for line in stream.splitlines()
              if line.startswith("data: {")]
    return next(e["usage"] for e in events if not e.get("choices") and e.get("usage"))


def check_whole(prefilled: dict, energy: dict) -> None:
    part = prefilled["usage"]["energy"]
    prefill, decode = energy["instances"]
    assert (prefill["role"], prefill["verified"], decode["role"]) == ("prefill", True, "decode")
    assert prefill["joules"] == pytest.approx(part["joules"], rel=1e-9)
    assert energy["joules"] == pytest.approx(prefill["joules"] + decode["joules"], rel=1e-9)
    assert math.fsum(energy["breakdown"].values()) == pytest.approx(energy["joules"], rel=1e-9)
    assert energy["prefill_joules"] + energy["decode_joules"] == pytest.approx(
        energy["joules"], rel=1e-9)


def counts(server: VllmServer) -> dict[str, float]:
    """What a quiet instance counted: its outcomes, engine steps and received parts."""
    text = quiet_metrics(server)
    out = {f"outcome/{k}": v
           for k, v in by_label(text, "piep_request_outcome_joules_total", "outcome").items()}
    out["steps"] = total(text, "piep_engine_step_joules_total")
    out["received"] = total(text, "piep_peer_joules_total", verified="true")
    return out


def test_the_decode_response_carries_the_whole_request_and_each_instance_books_its_own(
        fleet: Fleet) -> None:
    before = [counts(server) for server in (fleet.prefill, fleet.decode)]
    totals = []
    prefilled, text = proxy(fleet, "/v1/completions",
                            {"model": "model", "prompt": PROMPT, "max_tokens": 8})
    assert PART_KEY in (prefilled.get("kv_transfer_params") or {})
    response = json.loads(text)
    energy = response["usage"]["energy"]
    check_whole(prefilled, energy)
    assert response["metrics"]["energy"] == energy  # --enable-per-request-metrics
    totals.append(energy["joules"])

    prefilled, text = proxy(fleet, "/v1/chat/completions", {
        "model": "model", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
        "stream": True, "stream_options": {"include_usage": True}})
    energy = final_usage(text)["energy"]
    check_whole(prefilled, energy)
    totals.append(energy["joules"])
    assert any(fleet.storage.rglob("*.safetensors"))  # the connector moved KV through files

    # Each instance counts its own joules: the prefill instance the requests it handed off,
    # the decode instance what it served and, apart, the parts it received. The clients'
    # totals are the two together, and the engines' steps are all accounted, once.
    after = [counts(server) for server in (fleet.prefill, fleet.decode)]
    prefill, decode = ({k: v - b.get(k, 0.0) for k, v in a.items()}
                       for a, b in zip(after, before, strict=True))
    assert prefill["outcome/finished"] == 0.0 and decode["outcome/handed_off"] == 0.0
    assert prefill["outcome/handed_off"] + decode["outcome/finished"] == pytest.approx(
        math.fsum(totals), rel=1e-9)
    assert decode["received"] == pytest.approx(prefill["outcome/handed_off"], rel=1e-9)
    assert prefill["received"] == 0.0
    elsewhere = math.fsum(v for d in (prefill, decode) for k, v in d.items()
                          if k.startswith("outcome/") and k not in ("outcome/finished",
                                                                     "outcome/handed_off"))
    assert prefill["steps"] + decode["steps"] == pytest.approx(
        math.fsum(totals) + elsewhere, rel=1e-9)


def test_a_client_cannot_bring_its_own_prefill_energy(fleet: Fleet) -> None:
    prefilled, _ = proxy(fleet, "/v1/completions",
                         {"model": "model", "prompt": PROMPT, "max_tokens": 4})
    forged = json.loads(json.dumps(prefilled["kv_transfer_params"]))
    forged[PART_KEY]["figures"]["joules"] *= 100
    before = total(fleet.decode.get_text("/metrics"), "piep_peer_rejected_total",
                   reason="bad_signature")
    body = {"model": "model", "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": forged}
    energy = json.loads(post(fleet.decode, "/v1/completions", body,
                             str(uuid.uuid4())))["usage"]["energy"]
    assert "instances" not in energy
    after = total(fleet.decode.get_text("/metrics"), "piep_peer_rejected_total",
                  reason="bad_signature")
    assert after == before + 1
