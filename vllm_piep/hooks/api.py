"""API server: take the engine's energy records off the outputs, count them on /metrics, and
put `usage.energy` on OpenAI responses (completions and chat, streaming or not, n > 1, several
prompts per request).

Records are popped from `EngineCoreOutput.kv_transfer_params` before vLLM's `OutputProcessor`
reads the field, so KV connectors and the response's own `kv_transfer_params` see exactly what
they would without the plugin. The serving methods are wrapped where the final `usage` is built:
the non-streaming builders get energy set on `response.usage`; the streaming generators get it
added to the final usage chunk (`stream_options.include_usage` or --enable-force-include-usage).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm_piep.carbon import GridIntensity
from vllm_piep.config import PiepConfig
from vllm_piep.hooks.patching import Patch
from vllm_piep.ledger import EnergyLedger, usage_energy
from vllm_piep.meters.serve_sampler import start_serve_meter
from vllm_piep.metrics import EnergyMetrics
from vllm_piep.once import OnceLogger
from vllm_piep.wire import HEADER_KEY, ROWS_KEY, RowCursor, is_rows

_once = OnceLogger()
_ledger: EnergyLedger | None = None
_config: PiepConfig | None = None


def configure(config: PiepConfig) -> None:
    """The API server's plugin options (from its command line), before the first request."""
    global _config
    _config = config


def ledger() -> EnergyLedger:
    """Created at the first engine output: by then vLLM has set up its metrics registry."""
    global _ledger
    if _ledger is None:
        _ledger = EnergyLedger(EnergyMetrics())
        _start_options(_ledger, _config or PiepConfig.from_sources(None))
    return _ledger


def _start_options(book: EnergyLedger, config: PiepConfig) -> None:
    """Grid carbon intensity and the serve-time meter, if configured; neither may stop
    serving (each logs its own problems once)."""
    try:
        grid = GridIntensity.from_config(config)
        if grid is not None:
            book.intensity = grid.current
    except Exception as exc:  # boundary
        _once.warn("reading the grid carbon intensity", exc, "responses carry no gco2e")
    try:
        start_serve_meter(config)
    except Exception as exc:  # boundary
        _once.warn("starting the serve-time meter", exc, "/metrics shows no measured energy")


# -- OutputProcessor ---------------------------------------------------------------------------
def _wrap_process_outputs(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_outputs(self: Any, engine_core_outputs: list[Any], *args: Any,
                        **kwargs: Any) -> Any:
        try:
            _collect(self, engine_core_outputs)
        except Exception as exc:  # boundary
            _once.warn("collecting energy records", exc, "some responses lack usage.energy")
            _strip(engine_core_outputs)  # what is left of ours must not reach vLLM's responses
        return original(self, engine_core_outputs, *args, **kwargs)

    return process_outputs


def _collect(processor: Any, outputs: list[Any]) -> None:
    book = ledger()
    states = processor.request_states
    # The first output of an engine batch carries the header and every output's row, in
    # order; vLLM may hand the batch over in chunks, so the cursor lives in the ledger.
    cursor = book.cursor
    for out in outputs:
        params = out.kv_transfer_params
        if params and HEADER_KEY in params:
            header = book.observe_header(params.pop(HEADER_KEY))
            blob = params.pop(ROWS_KEY, b"")
            if not params:
                out.kv_transfer_params = None
            if cursor is not None and cursor.left:
                _once.warn("matching energy rows to outputs",
                           ValueError(f"{cursor.left} rows of the previous batch were unused"),
                           "some outputs may carry no energy")
            cursor = book.cursor = RowCursor(header, blob if is_rows(blob) else b"")
        if cursor is None:
            continue
        row = cursor.take()
        header = cursor.header
        if row is None or header is None:
            continue
        state = states.get(out.request_id)
        if state is None:  # finished or aborted here already: count what came after
            book.late(out.request_id, header, row)
            continue
        external = state.parent_req.external_req_id if state.parent_req else state.external_req_id
        book.update(out.request_id, external, header, row)


def _strip(outputs: list[Any]) -> None:
    for out in outputs:
        params = out.kv_transfer_params
        if params:
            params.pop(HEADER_KEY, None)
            params.pop(ROWS_KEY, None)
            if not params:
                out.kv_transfer_params = None
    if _ledger is not None:
        _ledger.cursor = None


def _wrap_finish_request(original: Callable[..., Any]) -> Callable[..., Any]:
    def _finish_request(self: Any, req_state: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, req_state, *args, **kwargs)
        try:
            ledger().close(req_state.request_id, "finished")
        except Exception as exc:  # boundary
            _once.warn("closing a request's energy record", exc, "it may be missing on /metrics")
        return result

    return _finish_request


def _wrap_abort_requests(original: Callable[..., Any]) -> Callable[..., Any]:
    def abort_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        aborted = original(self, *args, **kwargs)
        try:
            book = ledger()
            for internal_id in aborted or ():
                book.close(internal_id, "aborted")
        except Exception as exc:  # boundary
            _once.warn("closing aborted requests' energy", exc, "it may be missing on /metrics")
        return aborted

    return abort_requests


# -- serving: set usage.energy -----------------------------------------------------------------
def _set_energy(usage: Any, request_ids: set[str]) -> None:
    if usage is None or not request_ids:
        return
    book = ledger()
    energy = usage_energy(book.take(request_ids), int(usage.completion_tokens or 0),
                          book.intensity())
    if energy is not None:
        usage.energy = energy.to_usage()


def _wrap_completion_response(original: Callable[..., Any]) -> Callable[..., Any]:
    def request_output_to_completion_response(self: Any, final_res_batch: list[Any],
                                              *args: Any, **kwargs: Any) -> Any:
        response = original(self, final_res_batch, *args, **kwargs)
        try:
            _set_energy(response.usage, {r.request_id for r in final_res_batch})
        except Exception as exc:  # boundary
            _once.warn("adding usage.energy to a completion", exc, "it went out without it")
        return response

    return request_output_to_completion_response


class _Tap:
    """Passes a result generator through, remembering the request ids it yields."""

    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._source = source
        self.request_ids: set[str] = set()
        self.exhausted = False

    def __aiter__(self) -> _Tap:
        return self

    async def __anext__(self) -> Any:
        try:
            item = await self._source.__anext__()
        except StopAsyncIteration:
            self.exhausted = True
            raise
        output = item[1] if isinstance(item, tuple) else item  # completions yield (index, out)
        request_id = getattr(output, "request_id", None)
        if request_id is not None:
            self.request_ids.add(request_id)
        return item

    async def aclose(self) -> None:
        close = getattr(self._source, "aclose", None)
        if close is not None:
            await close()


def _tapped(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[
        inspect.BoundArguments, _Tap]:
    bound = signature.bind(*args, **kwargs)
    tap = _Tap(bound.arguments["result_generator"])
    bound.arguments["result_generator"] = tap
    return bound, tap


def _wrap_full_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    async def chat_completion_full_generator(*args: Any, **kwargs: Any) -> Any:
        bound, tap = _tapped(signature, args, kwargs)
        response = await original(*bound.args, **bound.kwargs)
        try:
            _set_energy(getattr(response, "usage", None), tap.request_ids)
        except Exception as exc:  # boundary
            _once.warn("adding usage.energy to a chat completion", exc, "it went out without it")
        return response

    return chat_completion_full_generator


def _with_energy(chunk: str, tap: _Tap) -> str:
    """`data: {...}` with usage → the same event with usage.energy, once all requests are done."""
    if not chunk.startswith("data: {") or '"usage"' not in chunk:
        return chunk
    payload = json.loads(chunk[len("data: "):])
    usage = payload.get("usage")
    if not isinstance(usage, dict) or "energy" in usage:
        return chunk
    book = ledger()
    energy = usage_energy(book.take(tap.request_ids), int(usage.get("completion_tokens") or 0),
                          book.intensity())
    if energy is None:
        return chunk
    usage["energy"] = energy.to_usage()
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _wrap_stream_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    async def stream_generator(*args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound, tap = _tapped(signature, args, kwargs)
        try:
            async for chunk in original(*bound.args, **bound.kwargs):
                if tap.exhausted:  # only the final usage chunk follows the last output
                    try:
                        chunk = _with_energy(chunk, tap)
                    except Exception as exc:  # boundary
                        _once.warn("adding usage.energy to a stream", exc,
                                   "it went out without it")
                yield chunk
        finally:
            # A stream without a usage chunk, or cut short: nobody will take its records.
            if tap.request_ids and _ledger is not None:
                _ledger.take(tap.request_ids)

    return stream_generator


def patches() -> list[Patch]:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.v1.engine.output_processor import OutputProcessor

    return [
        Patch(OutputProcessor, "process_outputs", _wrap_process_outputs,
              why="pops energy records off engine outputs into the ledger"),
        Patch(OutputProcessor, "_finish_request", _wrap_finish_request,
              why="closes a finished request's record (counted on /metrics)"),
        Patch(OutputProcessor, "abort_requests", _wrap_abort_requests,
              why="closes aborted requests' records (counted on /metrics)"),
        Patch(OpenAIServingCompletion, "request_output_to_completion_response",
              _wrap_completion_response, why="usage.energy on non-streaming completions"),
        Patch(OpenAIServingCompletion, "completion_stream_generator", _wrap_stream_generator,
              why="usage.energy on the final usage chunk of streaming completions"),
        Patch(OpenAIServingChat, "chat_completion_full_generator", _wrap_full_generator,
              why="usage.energy on non-streaming chat completions"),
        Patch(OpenAIServingChat, "chat_completion_stream_generator", _wrap_stream_generator,
              why="usage.energy on the final usage chunk of streaming chat completions"),
    ]
