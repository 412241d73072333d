"""The API server's record collection fails safe: nothing of the plugin's reaches vLLM; rows
follow their outputs across the chunks of a batch; late outputs are counted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from vllm_piep.model.components import N_COMPONENTS
from vllm_piep.runtime.api_server import outputs as api
from vllm_piep.runtime.api_server.ledger import EnergyLedger
from vllm_piep.runtime.api_server.metrics import EnergyMetrics
from vllm_piep.runtime.record import (
    HEADER_KEY,
    PICKS_KEY,
    ROWS_KEY,
    StepHeader,
    WireRecord,
    encode_picks,
)


class BrokenStates:
    def get(self, _key: str) -> None:
        raise RuntimeError("injected failure")


def row(joules: float) -> bytes:
    return WireRecord("prior", "prior/x", True, joules / 2, joules / 2,
                      (joules / N_COMPONENTS,) * N_COMPONENTS).to_wire()


def header(step_joules: float) -> bytes:
    """A batch header carrying the engine's increment of step energy."""
    return StepHeader("prior", "prior/x", "0", step_joules, 0, True,
                      carries_counts=True).encode()


def test_failed_collection_strips_every_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "_ledger", EnergyLedger())
    seen = []
    process = api._wrap_process_outputs(lambda self, outs: seen.append(
        [o.kv_transfer_params for o in outs]))
    outputs = [
        SimpleNamespace(request_id="a", kv_transfer_params={ROWS_KEY: row(1.0) * 2,
                                                            HEADER_KEY: header(1.0),
                                                            "remote": 1}),
        SimpleNamespace(request_id="b", kv_transfer_params=None),
    ]
    process(SimpleNamespace(request_states=BrokenStates()), outputs)
    assert seen == [[{"remote": 1}, None]]  # a KV connector's own key is kept


def test_rows_in_later_chunks_of_a_batch_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM passes a batch of > 128 outputs to process_outputs in chunks; only the batch's
    first output carries the header and the rows block."""
    book = EnergyLedger()
    monkeypatch.setattr(api, "_ledger", book)
    process = api._wrap_process_outputs(lambda self, outs: None)
    states = {f"r{i}": SimpleNamespace(parent_req=None, request_id=f"r{i}") for i in range(3)}
    processor = SimpleNamespace(request_states=states)
    block = row(1.0) + row(2.0) + row(3.0)
    first_chunk = [SimpleNamespace(request_id="r0",
                                   kv_transfer_params={ROWS_KEY: block, HEADER_KEY: header(6)}),
                   SimpleNamespace(request_id="r1", kv_transfer_params=None)]
    second_chunk = [SimpleNamespace(request_id="r2", kv_transfer_params=None)]
    process(processor, first_chunk)
    process(processor, second_chunk)
    assert book.size == (3, 0)
    assert [book.take([f"r{i}"])[0].joules for i in range(3)] == pytest.approx([1, 2, 3])


def test_a_sparse_batch_s_rows_reach_only_the_outputs_it_picks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse engine's batch: rows for two of five outputs (across two chunks); a batch
    with nothing attached after it gives none, and a picks list that does not fit its block
    drops the rows (none reaches a wrong output)."""
    book = EnergyLedger()
    monkeypatch.setattr(api, "_ledger", book)
    process = api._wrap_process_outputs(lambda self, outs: None)
    states = {f"r{i}": SimpleNamespace(parent_req=None, request_id=f"r{i}") for i in range(6)}
    processor = SimpleNamespace(request_states=states)
    params = {ROWS_KEY: row(1.0) + row(4.0), HEADER_KEY: header(5),
              PICKS_KEY: encode_picks([1, 4])}
    process(processor, [SimpleNamespace(request_id="r0", kv_transfer_params=params),
                        SimpleNamespace(request_id="r1", kv_transfer_params=None),
                        SimpleNamespace(request_id="r2", kv_transfer_params=None)])
    process(processor, [SimpleNamespace(request_id="r3", kv_transfer_params=None),
                        SimpleNamespace(request_id="r4", kv_transfer_params=None)])
    assert params == {} or params is None or HEADER_KEY not in params
    process(processor, [SimpleNamespace(request_id=r, kv_transfer_params=None)
                        for r in ("r0", "r5")])  # the next batch, nothing attached
    assert book.size == (2, 0)
    assert [r.joules for r in book.take(["r1"])] == pytest.approx([1.0])
    assert [r.joules for r in book.take(["r4"])] == pytest.approx([4.0])
    assert book.take(["r0"]) == book.take(["r5"]) == []
    bad = {ROWS_KEY: row(1.0), HEADER_KEY: header(1), PICKS_KEY: encode_picks([0, 1])}
    process(processor, [SimpleNamespace(request_id="r2", kv_transfer_params=bad)])
    assert book.take(["r2"]) == []


def test_outputs_after_the_finish_are_counted_as_after_finish(
        monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    clock = [0.0]
    book = EnergyLedger(EnergyMetrics(registry), recent_s=5.0, clock=lambda: clock[0])
    monkeypatch.setattr(api, "_ledger", book)
    process = api._wrap_process_outputs(lambda self, outs: None)
    states = {"r0": SimpleNamespace(parent_req=None, request_id="r0")}
    processor = SimpleNamespace(request_states=states)
    process(processor, [SimpleNamespace(request_id="r0", kv_transfer_params={
        ROWS_KEY: row(1.0), HEADER_KEY: header(1.0)})])
    book.close("r0", "finished")  # a stop string found here: the engine goes on a little
    assert book.take(["r0"])[0].joules == pytest.approx(1.0)  # the response: what it saw
    del states["r0"]
    process(processor, [SimpleNamespace(request_id="r0", kv_transfer_params={
        ROWS_KEY: row(1.5), HEADER_KEY: header(0.5)})])

    def get(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    assert get("piep_request_outcome_joules_total", outcome="finished") == pytest.approx(1.0)
    assert get("piep_request_outcome_joules_total", outcome="after_finish") == pytest.approx(0.5)
    assert get("piep_energy_joules_total", source="prior") == pytest.approx(
        get("piep_engine_step_joules_total"))
    book.housekeep()
    assert get("piep_tracked_requests", where="api_recent") == 1
    clock[0] = 6.0
    book.housekeep()
    assert get("piep_tracked_requests", where="api_recent") == 0


def test_a_request_cancelled_before_its_first_output_arrived_is_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    book = EnergyLedger(EnergyMetrics(registry))
    monkeypatch.setattr(api, "_ledger", book)
    process = api._wrap_process_outputs(lambda self, outs: None)
    book.close("r0", "aborted")  # the client left while the prefill step ran
    process(SimpleNamespace(request_states={}), [SimpleNamespace(
        request_id="r0", kv_transfer_params={ROWS_KEY: row(2.0), HEADER_KEY: header(2.0)})])
    # The aborted request's energy, none of it counted before: `aborted`, not after a finish.
    aborted = registry.get_sample_value("piep_request_outcome_joules_total",
                                        {"outcome": "aborted"})
    assert aborted == pytest.approx(2.0) == registry.get_sample_value(
        "piep_engine_step_joules_total")
    assert registry.get_sample_value("piep_request_outcome_joules_total",
                                     {"outcome": "after_finish"}) == 0.0
