"""A request's energy served on another instance: disaggregated prefill and decode.

With vLLM's KV connectors a request's prefill runs on one instance and its decode on another;
the proxy in front (vLLM's disaggregated-serving proxy examples; llm-d's routing sidecar works
the same way) copies the prefill response's `kv_transfer_params` into the decode request. The prefill instance puts its own
energy for the request there, under `PART_KEY`, signed (`sign_part`); the decode instance takes
it out before vLLM or the connector reads the field, checks it (`PartReader`) and adds it to the
response it returns (`combine`): `usage.energy.joules` is then the whole request's, with each
instance's part in `usage.energy.instances`.

Only a part signed with the peer key the operator gives both instances (`peer_key`) is added:
an HMAC-SHA256 over the request id, the time it was issued and its figures. Without a key the
part is shown (`verified: false`) and not added; a part with a bad signature, for another
request, too old, or seen before is dropped and counted by its reason. A client that writes
energy into its own decode request can therefore neither raise nor lower what it is billed:
each instance's ledger books only its own joules.

No vLLM imports.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PART_KEY = "piep_energy"  # in kv_transfer_params
VERSION = 1
MAX_AGE_S = 600.0  # a prefill's part older than this is refused (a decode starts within it)
_SEEN = 65_536  # signatures remembered against replay
# vLLM's response ids are the request's base id (X-Request-Id, which the proxies forward to
# both instances) under an endpoint's prefix.
_ID_PREFIXES = ("chatcmpl-", "cmpl-", "resp_", "msg_")

Rejected = Literal["malformed", "bad_signature", "other_request", "expired", "replayed"]
REJECTED_REASONS: tuple[Rejected, ...] = get_args(Rejected)


class PeerFigures(BaseModel):
    """An instance's energy for its part of a request: what `usage.energy` says of it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    joules: float = Field(ge=0.0, allow_inf_nan=False)
    prefill_joules: float = Field(ge=0.0, allow_inf_nan=False)
    decode_joules: float = Field(ge=0.0, allow_inf_nan=False)
    breakdown: dict[str, float]
    source: str
    bundle: str
    gco2e: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)


class SignedPart(BaseModel):
    """`kv_transfer_params[PART_KEY]`: the prefill instance's figures for one request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    v: int
    role: Literal["prefill"]
    request_id: str
    issued_at: float
    figures: PeerFigures
    sig: str | None = None  # hex HMAC-SHA256; None: the instance has no peer key


class Received(BaseModel):
    """A part the decode instance took from its request: `verified` if its signature holds."""

    model_config = ConfigDict(frozen=True)

    role: str
    figures: PeerFigures
    verified: bool


def base_request_id(request_id: str) -> str:
    """The id both instances share: the response id without its endpoint's prefix."""
    for prefix in _ID_PREFIXES:
        if request_id.startswith(prefix):
            return request_id[len(prefix):]
    return request_id


def _message(request_id: str, issued_at: float, figures: PeerFigures) -> bytes:
    body = {"v": VERSION, "role": "prefill", "request_id": base_request_id(request_id),
            "issued_at": issued_at, "figures": figures.model_dump(mode="json")}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _signature(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def figures_of(usage_energy: Mapping[str, Any]) -> PeerFigures:
    """The figures of a response's `usage.energy` object."""
    return PeerFigures(**{name: usage_energy.get(name) for name in PeerFigures.model_fields
                          if name in usage_energy})


def sign_part(usage_energy: Mapping[str, Any], request_id: str, key: bytes | None,
              now: float | None = None) -> dict[str, Any]:
    """What the prefill instance puts under `PART_KEY` for this response's `usage.energy`;
    signed with `key` (None: unsigned, shown by the decode instance as unverified)."""
    figures = figures_of(usage_energy)
    issued_at = time.time() if now is None else now
    sig = None if key is None else _signature(key, _message(request_id, issued_at, figures))
    part = SignedPart(v=VERSION, role="prefill", request_id=base_request_id(request_id),
                      issued_at=issued_at, figures=figures, sig=sig)
    return part.model_dump(mode="json")


class PartReader:
    """The decode instance's check of the parts its requests bring (thread-safe): each signed
    part is accepted once, within `max_age_s` of when it was issued, for the request it was
    issued for. `on_rejected(reason)` counts what is dropped."""

    def __init__(self, key: bytes | None, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.time,
                 on_rejected: Callable[[str], None] | None = None) -> None:
        self._key = key
        self._max_age_s = max_age_s
        self._clock = clock
        self._on_rejected = on_rejected
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, raw: object, request_id: str) -> Received | None:
        """The part `raw` (what `kv_transfer_params[PART_KEY]` held) for the request whose
        response id is `request_id`, or None where it is dropped (counted)."""
        try:
            part = SignedPart.model_validate(raw)
        except ValidationError:
            return self._reject("malformed")
        if part.v != VERSION:
            return self._reject("malformed")
        if self._key is None:
            return Received(role=part.role, figures=part.figures, verified=False)
        if part.sig is None or not hmac.compare_digest(
                part.sig, _signature(self._key, _message(part.request_id, part.issued_at,
                                                         part.figures))):
            return self._reject("bad_signature")
        if part.request_id != base_request_id(request_id):
            return self._reject("other_request")
        if not math.isfinite(part.issued_at) or abs(self._clock() - part.issued_at) > \
                self._max_age_s:
            return self._reject("expired")
        with self._lock:
            if part.sig in self._seen:
                return self._reject("replayed")
            self._seen[part.sig] = None
            if len(self._seen) > _SEEN:
                self._seen.popitem(last=False)
        return Received(role=part.role, figures=part.figures, verified=True)

    def _reject(self, reason: Rejected) -> Received | None:
        """None: the part is dropped, counted by its reason."""
        if self._on_rejected is not None:
            self._on_rejected(reason)
        return None


def combine(own: Mapping[str, Any], parts: list[Received], completion_tokens: int,
            role: str = "decode") -> dict[str, Any]:
    """`usage.energy` of a response whose request was partly served elsewhere: the verified
    parts added to this instance's own (`own`, its `usage.energy`), every part listed in
    `instances` beside this instance's. The interval, a multiple of one instance's prediction,
    does not cover a sum and is dropped."""
    added = [p.figures for p in parts if p.verified]
    figures = [figures_of(own), *added]
    joules = math.fsum(f.joules for f in figures)
    names = dict.fromkeys(name for f in figures for name in f.breakdown)  # own's order first
    breakdown = {name: math.fsum(f.breakdown.get(name, 0.0) for f in figures) for name in names}
    sources = {f.source for f in figures}
    bundles = sorted({f.bundle for f in figures})
    carbon = [f.gco2e for f in figures]
    out = dict(own)
    out.update(
        joules=joules,
        joules_per_output_token=joules / completion_tokens if completion_tokens > 0 else None,
        prefill_joules=math.fsum(f.prefill_joules for f in figures),
        decode_joules=math.fsum(f.decode_joules for f in figures),
        breakdown=breakdown,
        source=sources.pop() if len(sources) == 1 else "mixed",
        bundle=",".join(bundles),
        instances=[*({"role": p.role, "joules": p.figures.joules, "source": p.figures.source,
                      "bundle": p.figures.bundle, "verified": p.verified} for p in parts),
                   {"role": role, "joules": own["joules"], "source": own["source"],
                    "bundle": own["bundle"], "verified": True}],
    )
    if added:
        out.update(interval=None, interval_level=None)
        if "gco2e" in own:
            out["gco2e"] = None if None in carbon else math.fsum(carbon)  # type: ignore[arg-type]
    return out
