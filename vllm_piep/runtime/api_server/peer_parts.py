"""API server: a request's energy across disaggregated prefill and decode instances
(`vllm_piep.peer_energy`).

- Prefill instance: a non-streaming response to a request that asked for a remote decode
  (`do_remote_decode`), or whose `kv_transfer_params` carry what the connector hands the decode
  instance, gets this instance's part of the request's energy in that field, under `PART_KEY`,
  signed with `peer_key`. The proxy copies the field into the decode request. The request is
  booked `handed_off`.
- Decode instance: the part is taken out of the request's `kv_transfer_params` when the request
  arrives (vLLM and the connector then read exactly what the proxy sent them otherwise), checked
  when the response is built, and added to its `usage.energy`, which lists both instances'
  parts (`instances`). Only this instance's own joules are counted as its own; received parts
  go to `piep_peer_joules_total`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vllm_piep.peer_energy import PART_KEY, PartReader, Received, combine, sign_part
from vllm_piep.runtime.api_server.metrics import EnergyMetrics

_MAX_PENDING = 4096  # requests whose part awaits their response (bounded against leaks)
_pending: OrderedDict[int, tuple[Any, object]] = OrderedDict()  # id(request) -> (request, raw)
_reader: PartReader | None = None
_key: bytes | None = None
_metrics: Callable[[], EnergyMetrics | None] = lambda: None


def configure(peer_key: str | None, metrics: Callable[[], EnergyMetrics | None]) -> None:
    """This instance's peer key (the `peer_key` option) and where its counters are (they are
    made at the first engine output), before the first request."""
    global _reader, _key, _metrics
    _key = None if peer_key is None else peer_key.encode()
    _metrics = metrics
    _reader = None


def reader() -> PartReader:
    global _reader
    if _reader is None:
        _reader = PartReader(_key, on_rejected=_count_rejected)
    return _reader


def _count_rejected(reason: str) -> None:
    metrics = _metrics()
    if metrics is not None:
        metrics.peer_rejected.labels(reason).inc()


def take_from_request(request: Any) -> None:
    """A request arriving: the part another instance put in its `kv_transfer_params`, taken out
    and kept for its response."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or PART_KEY not in params:
        return
    raw = params.pop(PART_KEY)
    if not params:
        request.kv_transfer_params = None  # as the proxy would have sent it without the part
    _pending[id(request)] = (request, raw)  # the request kept: its id stays its own
    while len(_pending) > _MAX_PENDING:
        _pending.popitem(last=False)


def parts_for(request: Any, request_id: str) -> list[Received]:
    """The checked parts the request brought (its response's id `request_id`); each is read
    once."""
    entry = _pending.pop(id(request), None)
    if entry is None or entry[0] is not request:
        return []
    part = reader().read(entry[1], request_id)
    return [] if part is None else [part]


def with_parts(energy: dict, parts: list[Received], completion_tokens: int) -> dict:
    """This instance's `usage.energy` with the parts served elsewhere, which are counted as
    received (never as this instance's own)."""
    if not parts:
        return energy
    metrics = _metrics()
    if metrics is not None:
        for part in parts:
            metrics.peer_joules.labels(part.role, str(part.verified).lower()).inc(
                part.figures.joules)
    return combine(energy, parts, completion_tokens)


def hands_off(request: Any, response: Any) -> bool:
    """Whether a response is a disaggregated prefill's: its request asked for a remote decode
    (`do_remote_decode`, which the proxy sets), or the connector put what it hands the decode
    instance in the response's `kv_transfer_params`."""
    asked = getattr(request, "kv_transfer_params", None)
    if isinstance(asked, dict) and asked.get("do_remote_decode") is True:
        return True
    params = getattr(response, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params)


def sign_into(response: Any, energy: dict, request_id: str) -> None:
    """The prefill instance's part, signed, into the response's `kv_transfer_params` (made
    where the connector returns none, as vLLM's example connector does: the proxy copies the
    field whatever it holds)."""
    response.kv_transfer_params = {**(response.kv_transfer_params or {}),
                                   PART_KEY: sign_part(energy, request_id, _key)}
