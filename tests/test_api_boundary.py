"""The API server's record collection fails safe: nothing of the plugin's reaches vLLM."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_piep.hooks import api
from vllm_piep.wire import HEADER_KEY, RECORD_KEY


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
