"""API server: take the engine's energy records off the outputs, count them on /metrics, and
hand them to the serving code (`endpoints.py`), which puts `usage.energy` on responses.

Records are popped from `EngineCoreOutput.kv_transfer_params` before vLLM's `OutputProcessor`
reads the field, so KV connectors and the response's own `kv_transfer_params` see exactly what
they would without the plugin.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_piep.config import PiepConfig
from vllm_piep.once import OnceLogger
from vllm_piep.runtime.api_server import peer_parts, tenant
from vllm_piep.runtime.api_server.carbon import GridIntensity
from vllm_piep.runtime.api_server.ledger import EnergyLedger, RequestInfo
from vllm_piep.runtime.api_server.meter_sampler import start_serve_meter
from vllm_piep.runtime.api_server.metrics import EnergyMetrics, unmeasured_reason
from vllm_piep.runtime.api_server.response_ids import (
    note_finished,
    note_request,
    owner_of,
)
from vllm_piep.runtime.patching import Patch
from vllm_piep.runtime.record import (
    HEADER_KEY,
    PICKS_KEY,
    ROW_BYTES,
    ROWS_KEY,
    RowCursor,
    is_picks,
    is_rows,
)

_once = OnceLogger()
_ledger: EnergyLedger | None = None
_config: PiepConfig | None = None
_cuda_devices: int | None = None
_model_name: str | None = None


def configure(config: PiepConfig, cuda_devices: int | None = None,
              model_name: str | None = None) -> None:
    """The API server's plugin options (from its command line), before the first request;
    `cuda_devices`: how many CUDA devices the instance uses (its meter's GPUs); `model_name`:
    the name responses give the base model (requests without a LoRA adapter count under it)."""
    global _config, _cuda_devices, _model_name
    _config, _cuda_devices, _model_name = config, cuda_devices, model_name
    tenant.configure(config.ledger is not None, config.tenant_header, config.tenant_hash_key)
    peer_parts.configure(config.peer_key, lambda: ledger().metrics)


def ledger() -> EnergyLedger:
    """Created at the first engine output: by then vLLM has set up its metrics registry."""
    global _ledger
    if _ledger is None:
        config = _config or PiepConfig.from_sources(None)
        _ledger = EnergyLedger(EnergyMetrics(unmeasured_reason=unmeasured_reason(config)))
        _start_options(_ledger, config)
        _start_housekeeping(_ledger)
    return _ledger


def _start_housekeeping(book: EnergyLedger, interval_s: float = 0.5) -> threading.Thread:
    """Expires unclaimed records and sets the state gauges while the server is idle too."""
    def run() -> None:
        while True:
            time.sleep(interval_s)
            try:
                book.housekeep()
            except Exception as exc:  # boundary: the thread must go on
                _once.warn("housekeeping the energy ledger", exc, "gauges may lag")

    thread = threading.Thread(target=run, name="piep-ledger-housekeeping", daemon=True)
    thread.start()
    return thread


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
        start_serve_meter(config, cuda_devices=_cuda_devices)
    except Exception as exc:  # boundary
        _once.warn("starting the serve-time meter", exc, "/metrics shows no measured energy")
    if config.ledger is not None:
        try:
            _start_billing_ledger(book, config)
        except Exception as exc:  # boundary (the start check opened it already)
            _once.warn(f"opening the billing ledger {config.ledger}", exc,
                       "no request's energy is kept in it")


def _start_billing_ledger(book: EnergyLedger, config: PiepConfig) -> None:
    from vllm_piep.ledger.writer import LedgerWriter

    assert config.ledger is not None and book.metrics is not None
    records = book.metrics.ledger_records
    writer = LedgerWriter(config.ledger, flush_s=config.ledger_flush_s,
                          on_written=records.labels("written").inc,
                          on_dropped=records.labels("dropped").inc)
    book.sink = writer.put


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
    # The first output of an engine batch carries the header and the outputs' rows, in
    # order; vLLM may hand the batch over in chunks, so the cursor lives in the ledger.
    cursor = book.cursor
    if outputs and not (cursor is not None and cursor.left) and (
            not outputs[0].kv_transfer_params
            or HEADER_KEY not in outputs[0].kv_transfer_params):
        return  # a batch (or the rest of one) with no row for any output: most, when sparse
    for out in outputs:
        params = out.kv_transfer_params
        if params and HEADER_KEY in params:
            header = book.observe_header(params.pop(HEADER_KEY))
            blob = params.pop(ROWS_KEY, b"")
            picks = params.pop(PICKS_KEY, None)
            if not params:
                out.kv_transfer_params = None
            if cursor is not None and cursor.left:
                _once.warn("matching energy rows to outputs",
                           ValueError(f"{cursor.left} rows of the previous batch were unused"),
                           "some outputs may carry no energy")
            if not is_rows(blob) or (picks is not None
                                     and not is_picks(picks, len(blob) // ROW_BYTES)):
                blob, picks = b"", None
            cursor = book.cursor = RowCursor(header, blob, picks)
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
        book.update(out.request_id, owner_of(state), header, row)


def _wrap_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_request(self: Any, request: Any, prompt: Any, parent_req: Any = None,
                    *args: Any, **kwargs: Any) -> Any:
        # A request already known is a streamed input's next chunk: noted once, when new.
        known = request.request_id in getattr(self, "request_states", ())
        result = original(self, request, prompt, parent_req, *args, **kwargs)
        if known:
            return result
        try:
            note_request(parent_req.request_id if parent_req is not None
                         else request.request_id)
            lora = getattr(request, "lora_request", None)
            model = lora.lora_name if lora is not None else _model_name
            book = ledger()
            if book.sink is not None:
                book.note_request(_request_info(self, request, model, book))
            elif model is not None:
                book.note_model(request.request_id, model)
        except Exception as exc:  # boundary
            _once.warn("noting a new request", exc, "its response carries no energy")
        return result

    return add_request


def _request_info(processor: Any, request: Any, model: str | None,
                  book: EnergyLedger) -> RequestInfo:
    """What the billing ledger's row says of a new request besides its energy."""
    state = processor.request_states.get(request.request_id)
    who = tenant.current()
    if who is not None and who[1] and book.metrics is not None:
        book.metrics.ledger_tenants_rejected.inc()
    return RequestInfo(request.request_id,
                       request_id=getattr(state, "external_req_id", None),
                       model=model, tenant=None if who is None else who[0],
                       arrival_at=time.time(),
                       prompt_tokens=getattr(state, "prompt_len", None))


def _output_tokens(state: Any) -> int | None:
    detokenizer = getattr(state, "detokenizer", None)
    return None if detokenizer is None else detokenizer.num_output_tokens()


def _tokens_of(processor: Any, ids: list[str]) -> dict[str, int | None]:
    """Output tokens of the requests these ids name (internal ids, or external ones)."""
    states, external = processor.request_states, getattr(processor, "external_req_ids", {})
    found: dict[str, int | None] = {}
    for rid in ids:
        for internal_id in (rid, *external.get(rid, ())):
            state = states.get(internal_id)
            if state is not None:
                found[internal_id] = _output_tokens(state)
    return found


def _strip(outputs: list[Any]) -> None:
    for out in outputs:
        params = out.kv_transfer_params
        if params:
            params.pop(HEADER_KEY, None)
            params.pop(ROWS_KEY, None)
            params.pop(PICKS_KEY, None)
            if not params:
                out.kv_transfer_params = None
    if _ledger is not None:
        _ledger.cursor = None


def _wrap_finish_request(original: Callable[..., Any]) -> Callable[..., Any]:
    def _finish_request(self: Any, req_state: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, req_state, *args, **kwargs)
        try:
            ledger().close(req_state.request_id, "finished", _output_tokens(req_state))
            note_finished(req_state)
        except Exception as exc:  # boundary
            _once.warn("closing a request's energy record", exc, "it may be missing on /metrics")
        return result

    return _finish_request


def _wrap_abort_requests(original: Callable[..., Any]) -> Callable[..., Any]:
    def abort_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The output tokens of what is aborted, read before the original drops the states
        # (only where the billing ledger keeps them).
        tokens: dict[str, int | None] = {}
        if _ledger is not None and _ledger.sink is not None and args:
            ids = list(args[0])  # an iterable the original must still get whole
            args = (ids, *args[1:])
            try:
                tokens = _tokens_of(self, ids)
            except Exception as exc:  # boundary
                _once.warn("reading aborted requests' tokens", exc,
                           "their ledger rows carry no output tokens")
        aborted = original(self, *args, **kwargs)
        try:
            book = ledger()
            for internal_id in aborted or ():
                book.close(internal_id, "aborted", tokens.get(internal_id))
        except Exception as exc:  # boundary
            _once.warn("closing aborted requests' energy", exc, "it may be missing on /metrics")
        return aborted

    return abort_requests


def forget(owners: set[str]) -> None:
    """Records a response took without showing them (a stream without a usage chunk, or cut
    short): counted as not returned."""
    if owners and _ledger is not None:
        _ledger.take(owners, returned=False)


def patches() -> list[Patch]:
    from vllm.v1.engine.output_processor import OutputProcessor

    return [
        Patch(OutputProcessor, "process_outputs", _wrap_process_outputs,
              why="pops energy records off engine outputs into the ledger",
              how="before the original: takes the step header and rows block off the batch's "
                  "first output's kv_transfer_params (restoring the field as it was) and "
                  "gives every output its row",
              until="EngineCoreOutput carries a field for plugins"),
        Patch(OutputProcessor, "add_request", _wrap_add_request,
              why="tells the response being built which engine requests are its own, once "
                  "per request (the client's X-Request-Id may repeat; vLLM's internal ids do "
                  "not)",
              how="after the original, adds the request's owner (its parent's id for n > 1) "
                  "to the serving method's open scope (`response_ids.py`), and notes the "
                  "served model or LoRA adapter it runs for the per-model counter",
              until="RequestOutput carries vLLM's internal request id"),
        Patch(OutputProcessor, "_finish_request", _wrap_finish_request,
              why="closes a finished request's record (counted on /metrics)",
              how="after the original: closes the request's ledger entry as finished",
              until="vLLM offers a request-finished callback"),
        Patch(OutputProcessor, "abort_requests", _wrap_abort_requests,
              why="closes aborted requests' records (counted on /metrics)",
              how="after the original: closes the aborted requests' ledger entries",
              until="vLLM offers a request-finished callback"),
    ]
