"""Disaggregated prefill and decode through the API server's own code (`peer_parts`,
`endpoints`), one instance after the other in this process: the prefill instance signs its part
into its response's `kv_transfer_params` and books the request `handed_off`; the proxy copies
the field into the decode request; the decode instance takes the part off the request before
vLLM sees it and returns the whole, booking only its own joules. What a client forges is never
added."""

from __future__ import annotations

import copy
import inspect
import json
import math
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from vllm_piep.model.components import COMPONENTS, N_COMPONENTS
from vllm_piep.peer_energy import PART_KEY
from vllm_piep.runtime.api_server import endpoints, peer_parts
from vllm_piep.runtime.api_server import outputs as api
from vllm_piep.runtime.api_server.ledger import EnergyLedger
from vllm_piep.runtime.api_server.metrics import EnergyMetrics
from vllm_piep.runtime.record import StepHeader, WireRecord

KEY = "the fleet's peer key, 32 bytes."
CONNECTOR = {"do_remote_prefill": True, "remote_engine_id": "e0", "remote_block_ids": [3, 4]}


class Instance:
    """One API server's ledger and metrics, installed while it serves."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, key: str | None) -> None:
        self.registry = CollectorRegistry()
        self.book = EnergyLedger(EnergyMetrics(self.registry))
        self.monkeypatch, self.key = monkeypatch, key

    def serving(self) -> Instance:
        self.monkeypatch.setattr(api, "_ledger", self.book)
        peer_parts.configure(self.key, lambda: self.book.metrics)
        return self

    def engine_did(self, owner: str, prefill: float, decode: float) -> None:
        """The engine's record of a finished request of this response."""
        total = prefill + decode
        row = WireRecord("prior", "prior/x", True, prefill, decode,
                         (total / N_COMPONENTS,) * N_COMPONENTS).to_wire()
        self.book.update(owner, owner, StepHeader("prior", "prior/x", "0", 0.0, 0, True), row)
        self.book.close(owner)

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def usage(completion_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(completion_tokens=completion_tokens, model_extra={})


def served(request: SimpleNamespace, request_id: str) -> endpoints.Served:
    return endpoints.Served(request, request_id)


def arrive(request: SimpleNamespace) -> None:
    """The decode instance's chat handler receives the request (its patched entry)."""
    async def create_chat_completion(self, request, raw_request=None): ...

    endpoints._take_part(inspect.signature(create_chat_completion), (None, request), {})


def prefill_response(instance: Instance, joules: tuple[float, float]) -> SimpleNamespace:
    """A non-streaming prefill response (max_tokens 1) whose connector hands the KV off."""
    instance.serving().engine_did("p1", *joules)
    response = SimpleNamespace(usage=usage(1), kv_transfer_params=dict(CONNECTOR))
    request = SimpleNamespace(kv_transfer_params={"do_remote_decode": True})
    endpoints._set_energy(response.usage, {"p1"}, served=served(request, "cmpl-r42"),
                          response=response)
    return response


def test_the_decode_response_carries_both_parts_and_each_instance_books_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode = Instance(monkeypatch, KEY), Instance(monkeypatch, KEY)
    response = prefill_response(prefill, (30.0, 0.5))
    own = response.usage.energy
    assert own["joules"] == pytest.approx(30.5) and "instances" not in own
    assert set(response.kv_transfer_params) == set(CONNECTOR) | {PART_KEY}
    assert prefill.metric("piep_request_outcome_joules_total", outcome="handed_off") == \
        pytest.approx(30.5)
    assert prefill.metric("piep_request_outcome_joules_total", outcome="finished") == 0.0

    # The proxy: the prefill response's kv_transfer_params into the decode request.
    request = SimpleNamespace(kv_transfer_params=copy.deepcopy(response.kv_transfer_params))
    decode.serving()
    arrive(request)
    assert request.kv_transfer_params == CONNECTOR  # what vLLM and the connector read
    decode.engine_did("d1", 0.0, 9.5)
    decode_usage = usage(8)
    endpoints._set_energy(decode_usage, {"d1"}, served=served(request, "chatcmpl-r42"))
    energy = decode_usage.energy
    assert energy["joules"] == pytest.approx(30.5 + 9.5, rel=1e-12)
    assert energy["prefill_joules"] == pytest.approx(30.0) and energy["decode_joules"] == \
        pytest.approx(10.0)
    assert energy["joules_per_output_token"] == pytest.approx(40.0 / 8)
    assert math.fsum(energy["breakdown"].values()) == pytest.approx(40.0, rel=1e-12)
    assert set(energy["breakdown"]) == set(COMPONENTS)
    assert energy["instances"] == [
        {"role": "prefill", "joules": pytest.approx(30.5), "source": "prior",
         "bundle": "prior/x", "verified": True},
        {"role": "decode", "joules": pytest.approx(9.5), "source": "prior", "bundle": "prior/x",
         "verified": True}]
    # Each instance's counters hold its own joules only; the received part is apart.
    assert decode.metric("piep_request_outcome_joules_total", outcome="finished") == \
        pytest.approx(9.5)
    assert decode.metric("piep_peer_joules_total", role="prefill", verified="true") == \
        pytest.approx(30.5)
    fleet = (prefill.metric("piep_energy_joules_total", source="prior")
             + decode.metric("piep_energy_joules_total", source="prior"))
    assert fleet == pytest.approx(energy["joules"], rel=1e-12)


@pytest.mark.parametrize("forge", ["raise", "lower", "unsigned", "replay"])
def test_a_client_cannot_change_what_it_is_billed(monkeypatch: pytest.MonkeyPatch,
                                                   forge: str) -> None:
    prefill, decode = Instance(monkeypatch, KEY), Instance(monkeypatch, KEY)
    part = prefill_response(prefill, (30.0, 0.5)).kv_transfer_params[PART_KEY]
    decode.serving()
    if forge == "replay":  # the genuine part, a second time
        first = SimpleNamespace(kv_transfer_params={PART_KEY: copy.deepcopy(part)})
        arrive(first)
        decode.engine_did("d0", 0.0, 1.0)
        endpoints._set_energy(usage(1), {"d0"}, served=served(first, "cmpl-r42"))
    elif forge == "unsigned":
        part = {**part, "sig": None}
    else:
        part["figures"]["joules"] = 300.0 if forge == "raise" else 0.0
    request = SimpleNamespace(kv_transfer_params={PART_KEY: part})
    arrive(request)
    assert request.kv_transfer_params is None  # nothing else was sent: as without the part
    decode.engine_did("d1", 0.0, 9.5)
    decode_usage = usage(8)
    endpoints._set_energy(decode_usage, {"d1"}, served=served(request, "cmpl-r42"))
    assert decode_usage.energy["joules"] == pytest.approx(9.5)
    assert "instances" not in decode_usage.energy
    reason = "replayed" if forge == "replay" else "bad_signature"
    assert decode.metric("piep_peer_rejected_total", reason=reason) == 1.0
    assert decode.metric("piep_request_outcome_joules_total", outcome="finished") == \
        pytest.approx(9.5 + (1.0 if forge == "replay" else 0.0))


def test_without_a_peer_key_the_prefill_part_is_shown_unverified(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode = Instance(monkeypatch, None), Instance(monkeypatch, None)
    part = prefill_response(prefill, (30.0, 0.5)).kv_transfer_params[PART_KEY]
    assert part["sig"] is None
    decode.serving()
    request = SimpleNamespace(kv_transfer_params={**CONNECTOR, PART_KEY: part})
    arrive(request)
    decode.engine_did("d1", 0.0, 9.5)
    decode_usage = usage(8)
    endpoints._set_energy(decode_usage, {"d1"}, served=served(request, "cmpl-r42"))
    energy = decode_usage.energy
    assert energy["joules"] == pytest.approx(9.5)
    assert [(i["role"], i["verified"]) for i in energy["instances"]] == [("prefill", False),
                                                                         ("decode", True)]
    assert decode.metric("piep_peer_joules_total", role="prefill", verified="false") == \
        pytest.approx(30.5)


@pytest.mark.parametrize(("remote_decode", "outcome"), [(True, "handed_off"),
                                                        (False, "finished")])
def test_a_prefill_whose_connector_returns_no_params_still_hands_its_part_on(
        monkeypatch: pytest.MonkeyPatch, remote_decode: bool, outcome: str) -> None:
    """vLLM's example connector (KV in files) returns no `kv_transfer_params`: the request's
    `do_remote_decode` says it is a prefill, and the part goes out in a field of its own; a
    request that asks for no remote decode is an ordinary one, unsigned."""
    instance = Instance(monkeypatch, KEY).serving()
    instance.engine_did("p1", 3.0, 1.0)
    response = SimpleNamespace(usage=usage(1), kv_transfer_params=None)
    request = SimpleNamespace(kv_transfer_params={"do_remote_decode": remote_decode})
    endpoints._set_energy(response.usage, {"p1"}, served=served(request, "cmpl-1"),
                          response=response)
    if remote_decode:
        assert set(response.kv_transfer_params) == {PART_KEY}
    else:
        assert response.kv_transfer_params is None
    assert instance.metric("piep_request_outcome_joules_total", outcome=outcome) == \
        pytest.approx(4.0)


def test_per_request_metrics_carry_the_same_energy(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's `--enable-per-request-metrics` puts a `metrics` object in responses (and in a
    stream's final usage chunk): it gets `energy`, the same object as `usage.energy`."""
    instance = Instance(monkeypatch, KEY).serving()
    instance.engine_did("p1", 3.0, 1.0)
    response = SimpleNamespace(usage=usage(4), kv_transfer_params=None,
                               metrics=SimpleNamespace(time_to_first_token_ms=1.0))
    endpoints._set_energy(response.usage, {"p1"}, response=response, carrier=response)
    assert response.metrics.energy == response.usage.energy
    assert response.usage.energy["joules"] == pytest.approx(4.0)

    instance.engine_did("p2", 1.0, 1.0)
    chunk = 'data: {"choices":[],"usage":{"completion_tokens":2},"metrics":{"mean_itl_ms":1.0}}'
    payload = endpoints._with_energy(chunk + "\n\n", {"p2"})
    data = json.loads(payload[len("data: "):])
    assert data["metrics"]["energy"] == data["usage"]["energy"]
    assert data["usage"]["energy"]["joules"] == pytest.approx(2.0)
