"""API server: whose request each engine request is, for the billing ledger
(`vllm_piep.ledger`): the configured header (`tenant_header`), else the OpenAI `user` field.

A middleware, outermost on vLLM's app, opens a slot per HTTP request in a context variable and
puts the header's value in it; the serving code's model check (`BaseServing._check_model` and the
pooling endpoints' own, run first by every OpenAI endpoint with the parsed request) adds the
request's `user`. The
`OutputProcessor.add_request` wrapper (`outputs.py`) reads the slot: requests are added in the
task that serves the HTTP request, or in tasks it starts, which copy the context. The value is
checked once per HTTP request (`vllm_piep.ledger.tenant`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from vllm_piep.ledger.tenant import clean_tenant
from vllm_piep.runtime.patching import Patch


class TenantSlot:
    __slots__ = ("header", "user", "resolved")

    def __init__(self, header: str | None) -> None:
        self.header = header
        self.user: object = None
        self.resolved: tuple[str | None, bool] | None = None


_SLOT: ContextVar[TenantSlot | None] = ContextVar("piep_tenant", default=None)
_enabled = False  # a billing ledger is configured: only then is the middleware added
_header: bytes | None = None  # the configured header, lower case (ASGI's spelling)
_hash_key: bytes | None = None


def configure(enabled: bool, header: str | None, hash_key: str | None) -> None:
    global _enabled, _header, _hash_key
    _enabled = enabled
    _header = None if header is None else header.lower().encode("latin-1")
    _hash_key = None if hash_key is None else hash_key.encode("utf-8")


def current() -> tuple[str | None, bool] | None:
    """(tenant, rejected) of the HTTP request being served, None outside one; `rejected` is
    said once per HTTP request (so that it is counted once, however many engine requests it
    makes). A header that is present decides, even when rejected: a client's `user` never
    stands in for the gateway's value."""
    slot = _SLOT.get()
    if slot is None:
        return None
    if slot.resolved is None:
        slot.resolved = clean_tenant(slot.header if slot.header is not None else slot.user,
                                     _hash_key)
        return slot.resolved
    return slot.resolved[0], False


class TenantMiddleware:
    """Pure ASGI (no task of its own): opens the slot, with the header's value, around the
    request."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        value = None
        if _header is not None:
            for name, raw in scope.get("headers", ()):
                if name == _header:
                    try:
                        value = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        value = "\x00"  # not text: rejected like a control character
                    break
        token = _SLOT.set(TenantSlot(value))
        try:
            await self.app(scope, receive, send)
        finally:
            _SLOT.reset(token)


def _wrap_init_middleware(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_entrypoints_middleware(args: Any, app: Any, *rest: Any, **kwargs: Any) -> Any:
        result = original(args, app, *rest, **kwargs)
        if _enabled:
            app.add_middleware(TenantMiddleware)  # added last: outermost
        return result

    return init_entrypoints_middleware


def _wrap_check_model(original: Callable[..., Any]) -> Callable[..., Any]:
    async def _check_model(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        slot = _SLOT.get()
        if slot is not None and slot.user is None:
            slot.user = getattr(request, "user", None)
        return await original(self, request, *args, **kwargs)

    return _check_model


def patches() -> list[Patch]:
    import vllm.entrypoints.launchers.app as app_module
    from vllm.entrypoints.pooling.base.serving import PoolingBaseServing
    from vllm.entrypoints.serve.engine.serving import BaseServing

    return [
        Patch(app_module, "init_entrypoints_middleware", _wrap_init_middleware,
              why="the billing ledger's tenant from a request header",
              how="after the original, adds an ASGI middleware (outermost) that puts the "
                  "configured header's value in a context variable for the request",
              until="vLLM hands request headers to the output processor"),
        Patch(BaseServing, "_check_model", _wrap_check_model,
              why="the billing ledger's tenant from the OpenAI `user` field, where no header "
                  "names it",
              how="before the original: notes the parsed request's `user` in the HTTP "
                  "request's context variable",
              until="vLLM hands the request's `user` to the output processor"),
        Patch(PoolingBaseServing, "_check_model", _wrap_check_model,
              why="the same for embeddings and the other pooling endpoints (their serving "
                  "class overrides the model check)",
              how="before the original: notes the parsed request's `user` in the HTTP "
                  "request's context variable",
              until="vLLM hands the request's `user` to the output processor"),
    ]
