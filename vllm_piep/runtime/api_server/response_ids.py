"""API server: which engine requests make up a response, learnt once per request, not per output.

A response's records are found in the ledger by its requests' *owners* (`owner_of`). The serving
code adds its engine requests (`AsyncLLM.generate` → `OutputProcessor.add_request`) in the
asyncio task that goes on to read their outputs, so a context variable set where a response
is built sees every request added for it: `collecting()` opens that scope around a serving
method, and the wrapper of `OutputProcessor.add_request` (`outputs.py`) adds each new
request's owner to the innermost open scope. Nothing is done per output or per stream chunk.

Tasks that the serving code starts inside a scope (vLLM's `merge_async_iterators` runs each
prompt's generator in a task of its own) copy the context, and with it the same set. A scope
opened inside another one hands its owners to the outer one when it closes.

Offline inference (`vllm.LLM`) has no serving method: its finished outputs find their owner by
their external request id (`finished_owner`), which `LLM` makes unique, remembered only in the
process that steps an `LLMEngine` (`remember_finished_owners`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_OWNERS: ContextVar[set[str] | None] = ContextVar("piep_response_owners", default=None)
_MAX_FINISHED = 4096  # finished outputs are read in the step that finishes them

_finished: OrderedDict[str, str] | None = None


def owner_of(state: Any) -> str:
    """The internal id a response is known by: its request's, or its parent's for n > 1
    samples (unique even when clients reuse X-Request-Id, unlike the external id)."""
    parent = state.parent_req
    return parent.request_id if parent is not None else state.request_id


@contextmanager
def collecting(into: set[str] | None = None) -> Iterator[set[str]]:
    """A scope whose engine requests' owners are gathered in the set it yields (`into`, or a
    new one)."""
    outer = _OWNERS.get()
    owners: set[str] = set() if into is None else into
    token = _OWNERS.set(owners)
    try:
        yield owners
    finally:
        try:
            _OWNERS.reset(token)
        except ValueError:  # an async generator closed from another task: its context is gone
            pass
        if outer is not None and outer is not owners:
            outer |= owners


def open_scope() -> set[str]:
    """The owners gathered so far by the innermost open scope (empty outside one)."""
    return _OWNERS.get() or set()


def note_request(owner: str) -> None:
    """A request added to the engine: its owner joins the open scope, if any."""
    owners = _OWNERS.get()
    if owners is not None:
        owners.add(owner)


def remember_finished_owners() -> None:
    """This process steps an `LLMEngine` (offline inference): remember finished requests'
    owners by external id from now on."""
    global _finished
    if _finished is None:
        _finished = OrderedDict()


def note_finished(state: Any) -> None:
    """A request vLLM finished: remembered by the external id its output carries, offline."""
    finished = _finished
    if finished is None:
        return
    parent = state.parent_req
    external = parent.external_req_id if parent is not None else state.external_req_id
    finished[external] = owner_of(state)
    while len(finished) > _MAX_FINISHED:
        finished.popitem(last=False)


def finished_owner(external_id: str) -> str | None:
    """The owner of the finished offline output with this request id (taken: asked once)."""
    return None if _finished is None else _finished.pop(external_id, None)
