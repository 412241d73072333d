"""API server: a finished request's energy on vLLM's own `llm_request` OpenTelemetry span.

With `--otlp-traces-endpoint`, vLLM's `OutputProcessor.do_tracing` makes one `llm_request` span
per request that finishes (`vllm.tracing.instrument_manual`: the span is started, given vLLM's
attributes and ended at once, never handed back). The plugin wraps `do_tracing`: the request's
energy attributes wait in a thread-local while the original runs, and a span processor added
to vLLM's tracer provider (`EnergySpanProcessor`, OpenTelemetry's public hook; `on_start` gets
the span while it can still take attributes) sets them on that span. By then vLLM has finished
the request (`_finish_request` runs before `do_tracing`), so its record is closed in the ledger.
Nothing changes without tracing: vLLM calls `do_tracing` only when it is configured.

The attributes (`energy_attributes`) are in the `piep.energy.` namespace: OpenTelemetry's
`gen_ai.*` semantic conventions define no energy attributes, and names outside a convention
belong under a prefix of their own. One span is one engine request, so an `n > 1` response's
samples each carry their own (the response's `usage.energy` is their sum).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

try:
    from opentelemetry.sdk.trace import SpanProcessor
except ImportError:  # no OpenTelemetry SDK: vLLM cannot trace either
    SpanProcessor = object  # type: ignore[assignment,misc]

from vllm_piep.model.components import COMPONENTS
from vllm_piep.once import OnceLogger
from vllm_piep.runtime.api_server.ledger import usage_energy
from vllm_piep.runtime.api_server.outputs import ledger
from vllm_piep.runtime.patching import Patch

PREFIX = "piep.energy."
SPAN_NAME = "llm_request"  # vLLM's (`OutputProcessor.do_tracing`)

_once = OnceLogger()
_pending = threading.local()  # the attributes of the request whose span is being made
_registered: list[Any] = []  # the provider the processor was added to (once per process)


def energy_attributes(req_state: Any) -> dict[str, Any]:
    """The span attributes of a finished request's energy, from its closed record; only
    `piep.energy.complete` False when a step of it went unaccounted, none without a record."""
    book = ledger()
    record = book.finished_record(req_state.request_id)
    if record is None:
        return {}
    stats = getattr(req_state, "stats", None)
    tokens = int(getattr(stats, "num_generation_tokens", 0) or 0)
    energy = usage_energy([record], tokens, book.intensity())
    if energy is None:
        return {PREFIX + "complete": False}
    attributes: dict[str, Any] = {
        PREFIX + "complete": True,
        PREFIX + "joules": energy.joules,
        PREFIX + "prefill_joules": energy.prefill_joules,
        PREFIX + "decode_joules": energy.decode_joules,
        PREFIX + "source": energy.source,
        PREFIX + "bundle": energy.bundle,
    }
    if energy.joules_per_output_token is not None:
        attributes[PREFIX + "joules_per_output_token"] = energy.joules_per_output_token
    for name in COMPONENTS:
        attributes[f"{PREFIX}breakdown.{name}"] = energy.breakdown[name]
    if energy.meter is not None:
        attributes[PREFIX + "meter"] = energy.meter
        if energy.predicted_joules is not None:
            attributes[PREFIX + "predicted_joules"] = energy.predicted_joules
    if energy.interval is not None:
        attributes[PREFIX + "interval_low"], attributes[PREFIX + "interval_high"] = \
            energy.interval
    if energy.gco2e is not None:
        attributes[PREFIX + "gco2e"] = energy.gco2e
    return attributes


class EnergySpanProcessor(SpanProcessor):
    """An OpenTelemetry span processor that sets the pending energy attributes on the
    `llm_request` span being started (module docstring); its other hooks do nothing."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        attributes = getattr(_pending, "attributes", None)
        if attributes and span.name == SPAN_NAME:
            span.set_attributes(attributes)


def _tracer_provider() -> Any:
    """The process's global tracer provider, which vLLM's tracing set up."""
    from opentelemetry import trace

    return trace.get_tracer_provider()


def _register() -> bool:
    """The processor on vLLM's tracer provider (the SDK's, which vLLM sets up with tracing);
    False where the global provider takes no processors."""
    provider = _tracer_provider()
    if _registered:
        return _registered[0] is provider
    add = getattr(provider, "add_span_processor", None)
    if add is None:
        _once.warn("adding energy to vLLM's trace spans",
                   TypeError(f"the tracer provider {type(provider).__name__} takes no span "
                             "processors"), "spans carry no energy")
        return False
    add(EnergySpanProcessor())
    _registered.append(provider)
    return True


def _wrap_do_tracing(original: Callable[..., Any]) -> Callable[..., Any]:
    def do_tracing(self: Any, engine_core_output: Any, req_state: Any, *args: Any,
                   **kwargs: Any) -> Any:
        attributes = None
        try:
            if _register():
                attributes = energy_attributes(req_state)
        except Exception as exc:  # boundary: the span goes out as vLLM makes it
            _once.warn("adding energy to a trace span", exc, "spans carry no energy")
        _pending.attributes = attributes
        try:
            return original(self, engine_core_output, req_state, *args, **kwargs)
        finally:
            _pending.attributes = None

    return do_tracing


def patches() -> list[Patch]:
    from vllm.v1.engine.output_processor import OutputProcessor

    return [Patch(OutputProcessor, "do_tracing", _wrap_do_tracing,
                  why="a finished request's energy on vLLM's llm_request trace span",
                  how="around the original: the request's energy attributes (piep.energy.*) "
                      "wait while it runs, and a span processor added to vLLM's tracer "
                      "provider sets them on the span it starts",
                  until="vLLM lets a plugin add attributes to its request spans")]
