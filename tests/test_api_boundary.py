"""The API server's record collection fails safe: nothing of the plugin's reaches vLLM."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_piep.hooks import api
from vllm_piep.wire import HEADER_KEY, RECORD_KEY, StepHeader, WireRecord


class BrokenStates:
    def get(self, _key: str) -> None:
        raise RuntimeError("injected failure")


def test_failed_collection_strips_every_record() -> None:
    seen = []
    process = api._wrap_process_outputs(lambda self, outs: seen.append(
        [o.kv_transfer_params for o in outs]))
    outputs = [
        SimpleNamespace(request_id="a", kv_transfer_params={RECORD_KEY: b"x", HEADER_KEY: [2]}),
        SimpleNamespace(request_id="b", kv_transfer_params={RECORD_KEY: b"y", "remote": 1}),
        SimpleNamespace(request_id="c", kv_transfer_params=None),
    ]
    process(SimpleNamespace(request_states=BrokenStates()), outputs)
    assert seen == [[None, {"remote": 1}, None]]  # a KV connector's own key is kept


def test_records_in_later_chunks_of_a_batch_are_kept(monkeypatch) -> None:
    """vLLM passes a batch of > 128 outputs to process_outputs in chunks; only the batch's
    first output carries the step header."""
    from vllm_piep.ledger import EnergyLedger

    book = EnergyLedger()
    monkeypatch.setattr(api, "_ledger", book)
    process = api._wrap_process_outputs(lambda self, outs: None)
    header = StepHeader("prior", "prior/x", "0", 3.0, 0, True).encode()
    row = WireRecord("prior", "prior/x", True, 0.5, 0.5, (0.1,) * 10).to_wire()
    states = {f"r{i}": SimpleNamespace(parent_req=None, external_req_id=f"e{i}")
              for i in range(3)}
    processor = SimpleNamespace(request_states=states)
    first_chunk = [SimpleNamespace(request_id="r0",
                                   kv_transfer_params={RECORD_KEY: row, HEADER_KEY: header}),
                   SimpleNamespace(request_id="r1", kv_transfer_params={RECORD_KEY: row})]
    second_chunk = [SimpleNamespace(request_id="r2", kv_transfer_params={RECORD_KEY: row})]
    process(processor, first_chunk)
    process(processor, second_chunk)
    assert book.size == (3, 0)
    assert [len(book.take([f"e{i}"])) for i in range(3)] == [1, 1, 1]
