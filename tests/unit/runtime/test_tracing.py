"""A finished request's energy on vLLM's `llm_request` span (`tracing.py`): the span processor
sets the request's `piep.energy.*` attributes on the span `do_tracing` starts, from its closed
record; other spans, requests without a record, and a provider without processors are left as
they were. With OpenTelemetry's SDK and an in-memory exporter; the real server and OTLP
receiver are in tests/e2e."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from vllm_piep.model.components import COMPONENTS, N_COMPONENTS
from vllm_piep.runtime.api_server import outputs as api
from vllm_piep.runtime.api_server import tracing
from vllm_piep.runtime.api_server.ledger import EnergyLedger
from vllm_piep.runtime.record import StepHeader, WireRecord

HEADER = StepHeader("prior", "prior/x", "0", 0.0, 0, True)


def row(prefill: float, decode: float, complete: bool = True) -> bytes:
    parts = [(prefill + decode) * (i + 1) / sum(range(1, N_COMPONENTS + 1))
             for i in range(N_COMPONENTS)]
    return WireRecord("prior", "prior/x", complete, prefill, decode, tuple(parts)).to_wire()


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> tuple[EnergyLedger, InMemorySpanExporter, Any]:
    """A ledger, an SDK tracer provider as vLLM sets one up, its exported spans, and
    `do_tracing` (a stand-in making the span as vLLM's does) through the plugin's wrapper."""
    book = EnergyLedger()
    monkeypatch.setattr(api, "_ledger", book)
    provider, exported = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    monkeypatch.setattr(tracing, "_tracer_provider", lambda: provider)
    monkeypatch.setattr(tracing, "_registered", [])

    def do_tracing(self: Any, engine_core_output: Any, req_state: Any, stats: Any) -> None:
        span = provider.get_tracer("vllm").start_span(tracing.SPAN_NAME, start_time=1)
        span.set_attributes({"gen_ai.usage.completion_tokens":
                             req_state.stats.num_generation_tokens})
        provider.get_tracer("vllm").start_span("other").end()
        span.end()

    return book, exported, tracing._wrap_do_tracing(do_tracing)


def finished(book: EnergyLedger, req_id: str, prefill: float, decode: float,
             complete: bool = True) -> SimpleNamespace:
    book.update(req_id, req_id, HEADER, row(prefill, decode, complete))
    book.close(req_id, "finished")
    return SimpleNamespace(request_id=req_id, stats=SimpleNamespace(num_generation_tokens=4))


def spans(exported: InMemorySpanExporter) -> dict[str, dict[str, Any]]:
    return {s.name: dict(s.attributes or {}) for s in exported.get_finished_spans()}


def test_the_request_span_carries_the_requests_energy(traced: Any) -> None:
    book, exported, do_tracing = traced
    do_tracing(None, None, finished(book, "r1", prefill=1.0, decode=3.0), None)
    got = spans(exported)
    span, other = got[tracing.SPAN_NAME], got["other"]
    p = tracing.PREFIX
    assert span[p + "joules"] == pytest.approx(4.0)
    assert (span[p + "prefill_joules"], span[p + "decode_joules"]) == pytest.approx((1.0, 3.0))
    assert span[p + "joules_per_output_token"] == pytest.approx(1.0)  # 4 J over 4 tokens
    assert math.fsum(span[f"{p}breakdown.{c}"] for c in COMPONENTS) == pytest.approx(4.0)
    assert span[p + "source"] == "prior" and span[p + "bundle"] == "prior/x"
    assert span[p + "complete"] is True
    assert span["gen_ai.usage.completion_tokens"] == 4  # vLLM's own attributes stay
    assert not any(k.startswith(p) for k in other)
    assert book.size == (0, 1)  # the record still waits for its response: nothing taken


def test_a_request_without_a_record_or_with_an_unaccounted_step(traced: Any) -> None:
    book, exported, do_tracing = traced
    do_tracing(None, None, SimpleNamespace(request_id="unknown",
                                       stats=SimpleNamespace(num_generation_tokens=0)), None)
    assert not any(k.startswith(tracing.PREFIX) for k in spans(exported)[tracing.SPAN_NAME])
    exported.clear()
    do_tracing(None, None, finished(book, "r2", 1.0, 1.0, complete=False), None)
    span = spans(exported)[tracing.SPAN_NAME]
    assert {k: v for k, v in span.items() if k.startswith(tracing.PREFIX)} == {
        tracing.PREFIX + "complete": False}


def test_a_provider_without_processors_leaves_the_span_as_vllm_made_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.trace import ProxyTracerProvider

    monkeypatch.setattr(tracing, "_tracer_provider", ProxyTracerProvider)
    monkeypatch.setattr(tracing, "_registered", [])
    called = []
    wrapped = tracing._wrap_do_tracing(lambda self, out, state, stats: called.append(state))
    wrapped(None, None, "state", None)
    assert called == ["state"]


def test_the_pending_attributes_never_outlive_the_call(traced: Any) -> None:
    book, exported, _ = traced

    def failing(self: Any, out: Any, state: Any, stats: Any) -> None:
        raise RuntimeError("vLLM's own failure")

    with pytest.raises(RuntimeError):
        tracing._wrap_do_tracing(failing)(None, None, finished(book, "r3", 1.0, 1.0), None)
    assert getattr(tracing._pending, "attributes", None) is None
