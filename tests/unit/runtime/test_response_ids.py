"""A response learns its engine requests once per request (`response_ids.py`): the scope a
serving method opens gathers the owners of the requests added inside it, in its task and in
tasks started there, and a stream's final usage chunk, and only it, carries their energy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_piep.model.components import N_COMPONENTS
from vllm_piep.runtime.api_server import endpoints
from vllm_piep.runtime.api_server import outputs as api
from vllm_piep.runtime.api_server.ledger import EnergyLedger
from vllm_piep.runtime.api_server.response_ids import collecting, note_request, open_scope
from vllm_piep.runtime.record import StepHeader, WireRecord

HEADER = StepHeader("prior", "prior/x", "0", 0.0, 0, True)


def row(joules: float) -> bytes:
    return WireRecord("prior", "prior/x", True, joules / 2, joules / 2,
                      (joules / N_COMPONENTS,) * N_COMPONENTS).to_wire()


def add_request() -> Any:
    """vLLM's `OutputProcessor.add_request` through the plugin's wrapper."""
    return api._wrap_add_request(lambda self, request, prompt, parent_req=None, *rest: None)


def request(req_id: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id)


@pytest.fixture
def book(monkeypatch: pytest.MonkeyPatch) -> EnergyLedger:
    book = EnergyLedger()
    monkeypatch.setattr(api, "_ledger", book)
    return book


def test_a_scope_gathers_its_tasks_requests_and_hands_them_to_the_outer_one() -> None:
    add = add_request()

    async def prompt(req_id: str) -> None:
        add(None, request(req_id), None)

    async def serve() -> tuple[set[str], set[str]]:
        with collecting() as outer:
            add(None, request("a"), None)
            add(None, request("a_child"), None, SimpleNamespace(request_id="parent"))
            with collecting() as inner:
                # vLLM's merge_async_iterators: each prompt's generator in a task of its own
                await asyncio.gather(*(asyncio.create_task(prompt(r)) for r in ("b", "c")))
                assert open_scope() == {"b", "c"}
        return outer, inner

    outer, inner = asyncio.run(serve())
    assert inner == {"b", "c"}
    assert outer == {"a", "parent", "b", "c"}


def test_outside_a_scope_nothing_is_gathered() -> None:
    note_request("x")
    assert open_scope() == set()
    add_request()(None, request("y"), None)  # a pooling endpoint: no scope, no cost
    assert open_scope() == set()


def test_two_responses_in_flight_keep_their_own_requests() -> None:
    add = add_request()

    async def response(req_id: str) -> set[str]:
        with collecting() as owners:
            await asyncio.sleep(0)
            add(None, request(req_id), None)
            await asyncio.sleep(0)
        return owners

    async def both() -> list[set[str]]:
        return list(await asyncio.gather(response("r1"), response("r2")))

    assert asyncio.run(both()) == [{"r1"}, {"r2"}]


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def test_only_a_streams_final_usage_chunk_carries_the_energy(book: EnergyLedger) -> None:
    add = add_request()
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    chunks = [sse({"choices": [{"text": "\"choices\":[]"}], "usage": usage}),  # continuous
              sse({"choices": [{"text": "b"}]}),
              sse({"choices": [], "usage": usage}),
              "data: [DONE]\n\n"]

    async def stream_generator(self: Any, request_: Any, result_generator: Any
                               ) -> AsyncIterator[str]:
        add(None, request("r1"), None)
        add(None, request("r2"), None)
        book.update("r1", "r1", HEADER, row(2.0))
        book.update("r2", "r2", HEADER, row(6.0))
        book.close("r1")
        book.close("r2")
        for chunk in chunks:
            yield chunk

    wrapped = endpoints._wrap_stream_generator(stream_generator)

    async def read() -> list[str]:
        return [chunk async for chunk in wrapped(None, None, None)]

    got = asyncio.run(read())
    assert got[0] == chunks[0] and got[1] == chunks[1] and got[3] == chunks[3]
    energy = json.loads(got[2][len("data: "):])["usage"]["energy"]
    assert energy["joules"] == pytest.approx(8.0)
    assert energy["joules_per_output_token"] == pytest.approx(2.0)
    assert book.size == (0, 0)


def test_a_stream_cut_short_gives_its_records_up_and_closes_from_another_task(
        book: EnergyLedger) -> None:
    add = add_request()

    async def stream_generator(self: Any) -> AsyncIterator[str]:
        add(None, request("r1"), None)
        book.update("r1", "r1", HEADER, row(2.0))
        book.close("r1")
        yield sse({"choices": [{"text": "a"}]})
        yield sse({"choices": [{"text": "b"}]})

    async def cut() -> None:
        stream = endpoints._wrap_stream_generator(stream_generator)(None)
        await stream.__anext__()
        await asyncio.create_task(stream.aclose())  # as a finalizer would: another context

    asyncio.run(cut())
    assert book.size == (0, 0)  # taken as not returned, nothing kept
