"""API server: `usage.energy` on every text-generation endpoint's response.

Each wrapper opens a scope (`response_ids.collecting`) around the serving method that reads a
response's engine outputs: the requests added inside it are the response's (their owners, the
ledger's keys), learnt once per request, never per output or chunk. `usage.energy` is set where
vLLM builds the final `usage`:

- /v1/completions: the handler (`create_completion`) is the scope of a non-streaming response,
  whose usage gets the energy; a stream is its own scope, and its final usage chunk (SSE text,
  the one event without choices) gets it.
- /v1/chat/completions: the response builder or the stream generator is the scope; energy on
  the response's usage, or on the final usage chunk of a stream: the chunk object
  `chat_completion_stream_generator_raw` yields (vLLM 0.33, shared by plain chat, Anthropic
  and Cohere), or the SSE text (0.32).
- /v1/chat/completions/batch: the batch builder is the scope; energy on the response's usage.
- /v1/responses: `_generate_with_builtin_tools` is the scope (one engine request per turn),
  its owners kept on the conversation context; energy on the `ResponsesResponse` that
  `responses_full_generator` returns, which the streaming `response.completed` event carries
  too.
- /v1/messages (Anthropic): the chat wrappers above produce the energy (Anthropic's serving
  class is the chat one); it is copied into the message response and the `message_delta`
  event, whose usage model declares no extra fields.

Streams without a usage chunk (`stream_options.include_usage` off) carry none; their records
are taken when the stream ends so that nothing is kept.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm_piep.once import OnceLogger
from vllm_piep.peer_energy import Received
from vllm_piep.runtime.api_server import peer_parts
from vllm_piep.runtime.api_server.ledger import usage_energy
from vllm_piep.runtime.api_server.outputs import forget, ledger
from vllm_piep.runtime.api_server.response_ids import collecting, open_scope
from vllm_piep.runtime.patching import Patch

_once = OnceLogger()
_IDS = "_piep_request_ids"


def energy_for(request_ids: set[str], completion_tokens: int, handed_off: bool = False
               ) -> dict | None:
    """The `usage.energy` object of a response made of these engine requests (their records
    are taken from the ledger, booked `handed_off` where the response is a disaggregated
    prefill's), or None when one of them has no complete record."""
    if not request_ids:
        return None
    book = ledger()
    energy = usage_energy(book.take(request_ids, handed_off=handed_off), completion_tokens,
                          book.intensity())
    return None if energy is None else energy.to_usage()


class Served:
    """The request a response answers and the response's id, as the serving method got them:
    where the parts of the request served on another instance are found (`peer_parts`)."""

    __slots__ = ("_parts", "request", "request_id")

    def __init__(self, request: Any, request_id: Any) -> None:
        self.request = request
        self.request_id = request_id if isinstance(request_id, str) else ""
        self._parts: list[Received] | None = None

    @classmethod
    def of(cls, signature: inspect.Signature, args: tuple, kwargs: dict) -> Served:
        arguments = signature.bind_partial(*args, **kwargs).arguments
        return cls(arguments.get("request"), arguments.get("request_id"))

    def parts(self) -> list[Received]:
        """The checked parts the request brought, read once."""
        if self._parts is None:
            self._parts = ([] if self.request is None
                           else peer_parts.parts_for(self.request, self.request_id))
        return self._parts


def _energy(request_ids: set[str], completion_tokens: int, served: Served | None,
            response: Any = None) -> dict | None:
    """`energy_for`, with the parts the request brought from another instance added; where
    `response` hands the request off to a decode instance (a disaggregated prefill's), this
    instance's part is signed into its `kv_transfer_params`."""
    parts = served.parts() if served is not None else []
    handed_off = (served is not None and response is not None
                  and peer_parts.hands_off(served.request, response))
    energy = energy_for(request_ids, completion_tokens, handed_off)
    if energy is None:
        return None
    if handed_off:
        assert served is not None
        peer_parts.sign_into(response, energy, served.request_id)
    return peer_parts.with_parts(energy, parts, completion_tokens)


def _set_energy(usage: Any, request_ids: set[str], tokens_field: str = "completion_tokens",
                served: Served | None = None, response: Any = None, carrier: Any = None
                ) -> None:
    """`usage.energy` set (`response`: the non-streaming response it is in, which may hand
    the request off to a decode instance); with `--enable-per-request-metrics` the same
    object in the `metrics` of `carrier` (the response, or a stream's final usage chunk)."""
    if usage is None or "energy" in (getattr(usage, "model_extra", None) or {}):
        if served is not None:
            served.parts()  # read once, even where no energy goes out
        return
    energy = _energy(request_ids, int(getattr(usage, tokens_field, 0) or 0), served, response)
    if energy is not None:
        usage.energy = energy
        metrics = getattr(carrier, "metrics", None)
        if metrics is not None:
            metrics.energy = energy


# -- completions and chat, non-streaming -------------------------------------------------------
def _take_part(signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
    """A request arriving: the energy another instance served of it, taken out of its
    `kv_transfer_params` before vLLM reads them (`peer_parts`)."""
    try:
        request = signature.bind_partial(*args, **kwargs).arguments.get("request")
        if request is not None:
            peer_parts.take_from_request(request)
    except Exception as exc:  # boundary
        _once.warn("reading another instance's energy from a request", exc,
                   "its response shows only this instance's")


def _wrap_create_completion(original: Callable[..., Any]) -> Callable[..., Any]:
    """The completions handler: a scope for the requests of a non-streaming completion,
    read where its response is built (a stream opens its own scope where it runs); the part
    of the request another instance served, taken off the request."""
    signature = inspect.signature(original)

    async def create_completion(*args: Any, **kwargs: Any) -> Any:
        _take_part(signature, args, kwargs)
        with collecting():
            return await original(*args, **kwargs)

    return create_completion


def _wrap_create_chat_completion(original: Callable[..., Any]) -> Callable[..., Any]:
    """The chat handler: the part of the request another instance served, taken off the
    request (its response builders are the scopes)."""
    signature = inspect.signature(original)

    async def create_chat_completion(*args: Any, **kwargs: Any) -> Any:
        _take_part(signature, args, kwargs)
        return await original(*args, **kwargs)

    return create_chat_completion


def _wrap_completion_response(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def request_output_to_completion_response(*args: Any, **kwargs: Any) -> Any:
        response = original(*args, **kwargs)
        try:
            _set_energy(response.usage, open_scope(), served=Served.of(signature, args, kwargs),
                        response=response, carrier=response)
        except Exception as exc:  # boundary
            _once.warn("adding usage.energy to a completion", exc, "it went out without it")
        return response

    return request_output_to_completion_response


def _wrap_response_builder(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A coroutine that builds a response from the outputs of the requests it reads: its
    requests gathered while it runs, usage.energy set on what it returns."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        async def build(*args: Any, **kwargs: Any) -> Any:
            with collecting() as owners:
                response = await original(*args, **kwargs)
            try:
                _set_energy(getattr(response, "usage", None), owners,
                            served=Served.of(signature, args, kwargs), response=response,
                            carrier=response)
            except Exception as exc:  # boundary
                _once.warn(f"adding usage.energy to {what}", exc, "it went out without it")
            return response

        return build

    return make


# -- streaming ---------------------------------------------------------------------------------
def _is_final_usage(chunk: str) -> bool:
    """The SSE text of a stream's final usage chunk: the one event without choices."""
    return '"choices":[]' in chunk and chunk.startswith("data: {") and '"usage"' in chunk


def _with_energy(chunk: str, owners: set[str], served: Served | None = None) -> str:
    """The final usage chunk (`data: {...}`) with usage.energy, once all requests are done."""
    if not _is_final_usage(chunk):
        return chunk
    payload = json.loads(chunk[len("data: "):])
    usage = payload.get("usage")
    if not isinstance(usage, dict) or "energy" in usage:
        return chunk
    energy = _energy(owners, int(usage.get("completion_tokens") or 0), served)
    if energy is None:
        return chunk
    usage["energy"] = energy
    if isinstance(payload.get("metrics"), dict):  # --enable-per-request-metrics
        payload["metrics"]["energy"] = energy
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _chunk_with_energy(chunk: Any, owners: set[str], served: Served | None = None) -> Any:
    """The final usage chunk of a chat stream as vLLM 0.33 builds it (an object without
    choices), with usage.energy."""
    if not getattr(chunk, "choices", True):
        _set_energy(getattr(chunk, "usage", None), owners, served=served, carrier=chunk)
    return chunk


def _wrap_stream(finish: Callable[[Any, set[str], Served], Any]
                 ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A stream generator: its requests gathered where it runs; every chunk goes through
    `finish`, which passes all but the final usage chunk unchanged and adds the energy to that
    one: the SSE text of completions (both versions) and chat (vLLM 0.32), or the chunk
    objects that vLLM 0.33's `chat_completion_stream_generator_raw` yields for plain chat,
    Anthropic and Cohere to serialise each their own way. The records of a stream that ends
    without its usage chunk are taken as not returned."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        async def stream(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            served = Served.of(signature, args, kwargs)
            with collecting() as owners:
                try:
                    async for chunk in original(*args, **kwargs):
                        try:
                            chunk = finish(chunk, owners, served)
                        except Exception as exc:  # boundary
                            _once.warn("adding usage.energy to a stream", exc,
                                       "it went out without it")
                        yield chunk
                finally:
                    forget(owners)
                    served.parts()  # read once, even where no energy went out

        return stream

    return make


_wrap_stream_generator = _wrap_stream(_with_energy)
_wrap_stream_generator_raw = _wrap_stream(_chunk_with_energy)


# -- /v1/responses -----------------------------------------------------------------------------
def _context_owners(context: Any) -> set[str] | None:
    """The owners of a Responses API conversation's engine requests (one per turn; several
    with built-in tools), kept on its context object."""
    state = getattr(context, "__dict__", None)
    return None if state is None else state.setdefault(_IDS, set())


def _wrap_builtin_tools(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    async def _generate_with_builtin_tools(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        owners = None
        try:
            owners = _context_owners(signature.bind(*args, **kwargs).arguments.get("context"))
        except Exception as exc:  # boundary
            _once.warn("following a Responses API request", exc, "it goes out without energy")
        with collecting(owners):
            async for item in original(*args, **kwargs):
                yield item

    return _generate_with_builtin_tools


def _wrap_responses_full(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    async def responses_full_generator(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        response = await original(*bound.args, **bound.kwargs)
        try:
            context = bound.arguments.get("context")
            ids = getattr(context, "__dict__", {}).get(_IDS) or set()
            _set_energy(getattr(response, "usage", None), ids, "output_tokens",
                        carrier=response)
        except Exception as exc:  # boundary
            _once.warn("adding usage.energy to a Responses API response", exc,
                       "it went out without it")
        return response

    return responses_full_generator


# -- /v1/messages (Anthropic) ------------------------------------------------------------------
def _chunk_energy(item: Any) -> dict | None:
    """The energy a chat stream chunk carries (SSE text in vLLM 0.32, objects in 0.33)."""
    if isinstance(item, str):
        if item.startswith("data: {") and '"energy"' in item:
            usage = json.loads(item[len("data: "):]).get("usage")
            return usage.get("energy") if isinstance(usage, dict) else None
        return None
    usage = getattr(item, "usage", None)
    return (getattr(usage, "model_extra", None) or {}).get("energy")


def _event_with_energy(frame: str, energy: dict) -> str:
    """`event: message_delta\\ndata: {...}` with usage.energy added."""
    head, sep, data = frame.partition("data: ")
    payload = json.loads(data)
    usage = payload.get("usage")
    if not isinstance(usage, dict) or "energy" in usage:
        return frame
    usage["energy"] = energy
    return f"{head}{sep}{json.dumps(payload, separators=(',', ':'))}\n\n"


def _wrap_message_stream_converter(original: Callable[..., Any]) -> Callable[..., Any]:
    async def message_stream_converter(self: Any, generator: Any, *args: Any, **kwargs: Any
                                       ) -> AsyncIterator[str]:
        seen: list[dict] = []

        async def sniff() -> AsyncIterator[Any]:
            async for item in generator:
                try:
                    energy = _chunk_energy(item)
                    if energy is not None:
                        seen.append(energy)
                except Exception as exc:  # boundary
                    _once.warn("reading energy from a chat stream", exc,
                               "the message goes out without it")
                yield item

        async for frame in original(self, sniff(), *args, **kwargs):
            if seen and isinstance(frame, str) and frame.startswith("event: message_delta"):
                try:
                    frame = _event_with_energy(frame, seen[-1])
                except Exception as exc:  # boundary
                    _once.warn("adding usage.energy to a message stream", exc,
                               "it went out without it")
            yield frame

    return message_stream_converter


def _wrap_messages_full_converter(with_energy: Callable[[Any, dict], Any]
                                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def messages_full_converter(self: Any, generator: Any, *args: Any, **kwargs: Any
                                    ) -> Any:
            result = original(self, generator, *args, **kwargs)
            try:
                energy = _chunk_energy(generator)
                if energy is not None and getattr(result, "usage", None) is not None:
                    result = with_energy(result, energy)
            except Exception as exc:  # boundary
                _once.warn("adding usage.energy to a message", exc, "it went out without it")
            return result

        return messages_full_converter

    return make


def _anthropic_with_energy() -> Callable[[Any, dict], Any]:
    """Anthropic's usage model ignores fields it does not declare: the response is rebuilt as a
    subclass whose usage keeps `energy` (vLLM's router checks the class with isinstance)."""
    from pydantic import ConfigDict
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesResponse, AnthropicUsage

    class UsageWithEnergy(AnthropicUsage):
        model_config = ConfigDict(extra="allow")

    class MessagesResponseWithEnergy(AnthropicMessagesResponse):
        usage: UsageWithEnergy | None = None  # type: ignore[assignment]

    def with_energy(result: Any, energy: dict) -> Any:
        data = result.model_dump()
        data["usage"] = {**result.usage.model_dump(), "energy": energy}
        return MessagesResponseWithEnergy.model_validate(data)

    return with_energy


# -- the patches -------------------------------------------------------------------------------
_UNTIL = "vLLM lets a plugin add fields to a response's usage"


def chat_stream_patches() -> list[Patch]:
    """The chat stream patch of each vLLM version, 0.32's first: 0.32 has one generator of SSE
    text; 0.33 builds the chunks as objects in `chat_completion_stream_generator_raw`, which
    plain chat, Anthropic and Cohere share. A vLLM is patched at the one it has (`patches()`);
    docs/vllm.md lists both."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    return [
        Patch(OpenAIServingChat, "chat_completion_stream_generator", _wrap_stream_generator,
              why="usage.energy on the final usage chunk of chat streams",
              how="runs the original inside a scope that gathers its requests' owners; "
                  "rewrites the SSE usage chunk without choices (the final one)", until=_UNTIL,
              verified=("0.32.0",)),
        Patch(OpenAIServingChat, "chat_completion_stream_generator_raw",
              _wrap_stream_generator_raw, why="usage.energy on the final usage chunk of chat "
              "streams (plain chat and Anthropic messages)",
              how="runs the original inside a scope that gathers its requests' owners; sets "
                  "usage.energy on the chunk object without choices (the final usage chunk)",
              until=_UNTIL, verified=("0.33.0",)),
    ]


def patches() -> list[Patch]:
    """Completions and chat: part of the plugin's core group (all or none)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    sse, raw = chat_stream_patches()
    chat_stream = raw if raw.name in OpenAIServingChat.__dict__ else sse
    return [
        Patch(OpenAIServingCompletion, "create_completion", _wrap_create_completion,
              why="the requests of a non-streaming completion, gathered while it is served; "
                  "the energy a disaggregated prefill instance served of the request",
              how="takes the plugin's key out of the request's kv_transfer_params, then runs "
                  "the original inside a scope that gathers the owners of the requests it adds",
              until=_UNTIL),
        Patch(OpenAIServingCompletion, "request_output_to_completion_response",
              _wrap_completion_response, why="usage.energy on non-streaming completions",
              how="sets usage.energy on the response the original returns (with the parts "
                  "other instances served; a disaggregated prefill's signed into its "
                  "kv_transfer_params)", until=_UNTIL),
        Patch(OpenAIServingCompletion, "completion_stream_generator", _wrap_stream_generator,
              why="usage.energy on the final usage chunk of streaming completions",
              how="runs the original inside a scope that gathers its requests' owners; "
                  "rewrites the SSE usage chunk without choices (the final one)",
              until=_UNTIL),
        Patch(OpenAIServingChat, "create_chat_completion", _wrap_create_chat_completion,
              why="disaggregated prefill/decode: the energy the prefill instance served of a "
                  "request, which the proxy forwards in its kv_transfer_params",
              how="before the original, takes the plugin's key out of the request's "
                  "kv_transfer_params (vLLM and the KV connector see the rest as sent)",
              until=_UNTIL),
        Patch(OpenAIServingChat, "chat_completion_full_generator",
              _wrap_response_builder("a chat completion"),
              why="usage.energy on non-streaming chat completions (and Anthropic messages, "
                  "which are built from them)",
              how="runs the original inside a scope that gathers its requests' owners; sets "
                  "usage.energy on the response",
              until=_UNTIL),
        chat_stream,
    ]


def batch_chat_patches() -> list[Patch]:
    from vllm.entrypoints.openai.chat_completion.batch_serving import OpenAIServingChatBatch

    return [Patch(OpenAIServingChatBatch, "chat_completion_full_generator_batch",
                  _wrap_response_builder("a batch chat completion"),
                  why="usage.energy on batch chat completions",
                  how="runs the original inside a scope that gathers its requests' owners; "
                      "sets usage.energy on the response",
                  until=_UNTIL)]


def responses_patches() -> list[Patch]:
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    return [
        Patch(OpenAIServingResponses, "_generate_with_builtin_tools", _wrap_builtin_tools,
              why="the engine requests behind a Responses API response (one per turn)",
              how="runs the original inside a scope that gathers its requests' owners into "
                  "the conversation context",
              until=_UNTIL),
        Patch(OpenAIServingResponses, "responses_full_generator", _wrap_responses_full,
              why="usage.energy on Responses API responses, streamed (response.completed) or "
                  "not", how="sets usage.energy on the ResponsesResponse it returns",
              until=_UNTIL),
    ]


def anthropic_patches() -> list[Patch]:
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    return [
        Patch(AnthropicServingMessages, "messages_full_converter",
              _wrap_messages_full_converter(_anthropic_with_energy()),
              why="usage.energy on non-streaming Anthropic messages (its usage model drops "
                  "undeclared fields)",
              how="copies the chat response's usage.energy into a subclass of the message "
                  "response whose usage allows it", until=_UNTIL),
        Patch(AnthropicServingMessages, "message_stream_converter",
              _wrap_message_stream_converter,
              why="usage.energy on the message_delta event of streaming Anthropic messages",
              how="reads the energy off the final chat chunk it converts; adds it to the "
                  "message_delta event's usage", until=_UNTIL),
    ]


# Endpoints beyond completions and chat: each group installs on its own, so a vLLM that moved
# one of them still serves energy everywhere else.
OPTIONAL_GROUPS: dict[str, Callable[[], list[Patch]]] = {
    "batch chat": batch_chat_patches,
    "responses": responses_patches,
    "anthropic messages": anthropic_patches,
}
