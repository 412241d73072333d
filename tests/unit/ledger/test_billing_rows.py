"""What the API server hands the billing ledger (`EnergyLedger.sink`): a row per request under
the outcome /metrics counts it in, with its tenant and tokens, rows for later energy and for
the engine's energy that belongs to no request; their sum is exactly what /metrics counts.
The tenant: the configured header, else `user`, checked and optionally hashed."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client import CollectorRegistry

from vllm_piep.config import ConfigError, PiepConfig
from vllm_piep.ledger.schema import LedgerRow
from vllm_piep.ledger.tenant import MAX_TENANT_BYTES, clean_tenant
from vllm_piep.model.components import N_COMPONENTS
from vllm_piep.runtime.api_server import tenant
from vllm_piep.runtime.api_server.ledger import EnergyLedger, RequestInfo
from vllm_piep.runtime.api_server.metrics import OUTCOMES, EnergyMetrics
from vllm_piep.runtime.record import StepHeader, WireRecord


def row(joules: float, complete: bool = True) -> bytes:
    parts = tuple(joules / N_COMPONENTS for _ in range(N_COMPONENTS))
    return WireRecord("prior", "prior/x", complete, joules / 4, joules * 3 / 4, parts).to_wire()


def test_rows_sum_to_every_outcome_on_metrics_with_tenants_and_tokens() -> None:
    registry = CollectorRegistry()
    book = EnergyLedger(EnergyMetrics(registry))
    rows: list[LedgerRow] = []
    book.sink = rows.append
    plan = {"a": ("acme", 1.0), "b": ("acme", 2.0), "c": ("globex", 4.0), "d": (None, 8.0),
            "e": ("globex", 16.0)}
    for internal, (who, _) in plan.items():
        book.note_request(RequestInfo(internal, f"cmpl-{internal}", "llama", who, 1.0, 7))
    h = book.observe_header(StepHeader("prior", "prior/x", "0", 31.0 + 3.5, 0, True,
                                       carries_counts=True, unsent_joules=0.5,
                                       warmup_joules=3.0).encode())
    assert h is not None
    for internal, (_, joules) in plan.items():
        book.update(internal, internal, h, row(joules, complete=internal != "e"))
    for internal in ("a", "b", "c", "e"):
        book.close(internal, "finished", output_tokens=5)
    book.close("d", "aborted", output_tokens=2)
    book.take(["a", "b", "e"])
    book.take(["c"], returned=False)
    book.late("b", h, row(2.25))  # 0.25 J after its response
    counted = {o: registry.get_sample_value("piep_request_outcome_joules_total",
                                            {"outcome": o}) or 0.0 for o in OUTCOMES}
    from_rows: dict[str, float] = {}
    for r in rows:
        from_rows[r.outcome] = from_rows.get(r.outcome, 0.0) + r.joules
    assert from_rows == pytest.approx({o: v for o, v in counted.items() if v > 0}, rel=1e-12)
    assert math.fsum(r.joules for r in rows) == pytest.approx(31.0 + 3.5 + 0.25)
    by_id = {(r.internal_id, r.outcome): r for r in rows if r.kind == "request"}
    assert by_id[("a", "finished")].tenant == "acme"
    assert by_id[("a", "finished")].output_tokens == 5
    assert by_id[("a", "finished")].prompt_tokens == 7
    assert by_id[("d", "aborted")].output_tokens == 2 and by_id[("d", "aborted")].tenant is None
    assert by_id[("c", "not_returned")].tenant == "globex"
    assert by_id[("e", "incomplete")].joules == pytest.approx(16.0)
    late = by_id[("b", "after_finish")]
    assert late.tenant == "acme" and late.joules == pytest.approx(0.25)
    assert sum(late.breakdown.values()) == pytest.approx(0.25)
    assert {(r.outcome, r.engine) for r in rows if r.kind == "engine"} == {
        ("unsent", "0"), ("warmup", "0")}
    assert book._info == {}


def test_measured_idle_energy_is_an_engine_row_and_rows_carry_gco2e() -> None:
    book = EnergyLedger(EnergyMetrics(CollectorRegistry()))
    rows: list[LedgerRow] = []
    book.sink = rows.append
    book.intensity = lambda: 360.0
    raw = StepHeader("nvml", "prior/x", "1", 0.0, 0, True, carries_counts=True,
                     meter="nvml", idle_joules=36.0).encode()
    book.observe_header(raw)
    [idle] = rows
    assert (idle.kind, idle.outcome, idle.engine, idle.joules) == ("engine", "idle", "1", 36.0)
    assert idle.gco2e == pytest.approx(36.0 / 3.6e6 * 360.0)


@pytest.mark.parametrize("value, stored, rejected", [
    ("acme", "acme", False),
    (None, None, False),
    ("", None, False),
    ("a" * MAX_TENANT_BYTES, "a" * MAX_TENANT_BYTES, False),
    ("a" * (MAX_TENANT_BYTES + 1), None, True),
    ("é" * (MAX_TENANT_BYTES // 2 + 1), None, True),  # counted in bytes
    ("acme\nInjected: 1", None, True),
    ("tab\there", None, True),
    ("del\x7f", None, True),
    (17, None, True),
])
def test_a_tenant_is_kept_only_when_it_is_plain_text_of_at_most_256_bytes(
        value: object, stored: str | None, rejected: bool) -> None:
    assert clean_tenant(value) == (stored, rejected)


def test_a_hashed_tenant_is_keyed_stable_and_not_the_name() -> None:
    one, _ = clean_tenant("acme", b"k1")
    assert one == clean_tenant("acme", b"k1")[0] and len(one or "") == 32
    assert one != clean_tenant("acme", b"k2")[0] and "acme" not in (one or "")


def _serve(headers: list[tuple[bytes, bytes]], user: object = None
           ) -> tuple[str | None, bool] | None:
    """One HTTP request through the middleware, the model check and the point where vLLM
    adds engine requests (a task of its own, as vLLM's merged generators are)."""
    seen: list[tuple[str | None, bool] | None] = []

    class Request:
        pass

    async def check_model(self: object, request: object) -> None:
        return None

    checked = tenant._wrap_check_model(check_model)

    async def app(scope: dict, receive: object, send: object) -> None:
        request = Request()
        request.user = user  # type: ignore[attr-defined]
        await checked(None, request)

        async def add_request() -> None:
            seen.append(tenant.current())

        await asyncio.create_task(add_request())

    asyncio.run(tenant.TenantMiddleware(app)({"type": "http", "headers": headers}, None, None))
    return seen[0]


def test_the_header_decides_else_the_user_field(monkeypatch: pytest.MonkeyPatch) -> None:
    tenant.configure(True, "X-Tenant-Id", None)
    try:
        assert _serve([(b"x-tenant-id", b"acme")], user="someone") == ("acme", False)
        assert _serve([(b"other", b"x")], user="u-1") == ("u-1", False)
        assert _serve([]) == (None, False)
        # A rejected header decides too: the client's `user` does not stand in for it.
        assert _serve([(b"x-tenant-id", b"\x01bad")], user="u-1") == (None, True)
        assert _serve([(b"x-tenant-id", b"\xff\xfe")]) == (None, True)
        tenant.configure(True, None, "key")
        hashed, _ = _serve([(b"x-tenant-id", b"acme")], user="acme")  # header not configured
        assert hashed == clean_tenant("acme", b"key")[0]
    finally:
        tenant.configure(False, None, None)
    assert tenant.current() is None  # outside an HTTP request


def test_ledger_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="`tenant_header` applies to the billing ledger"):
        PiepConfig.from_sources({"piep": {"tenant_header": "x-tenant-id"}}, {})
    with pytest.raises(ConfigError, match="HTTP header name"):
        PiepConfig.from_sources({"piep": {"ledger": "l.db", "tenant_header": "x tenant"}}, {})
    with pytest.raises(ConfigError, match="ledger_flush_s"):
        PiepConfig.from_sources({}, {"PIEP_LEDGER": "l.db", "PIEP_LEDGER_FLUSH_S": "0"})
    config = PiepConfig.from_sources({}, {"PIEP_LEDGER": "l.db", "PIEP_TENANT_HEADER": "X-Org"})
    assert config.ledger == "l.db" and config.tenant_header == "x-org"


def test_energy_the_engine_reports_with_an_abort_is_booked_to_the_request_it_knows() -> None:
    """A request aborted before any output carried its row: a 0 J first row when the API
    server aborts it (with its tenant and tokens), then its energy when the engine's header
    names it; energy of a request this API server does not know stays an engine row."""
    registry = CollectorRegistry()
    book = EnergyLedger(EnergyMetrics(registry))
    rows: list[LedgerRow] = []
    book.sink = rows.append
    book.note_request(RequestInfo("x", "cmpl-x", "llama", "acme", 1.0, 9))
    book.close("x", "aborted", output_tokens=3)
    [first] = rows
    assert (first.outcome, first.joules, first.tenant, first.later) == (
        "aborted", 0.0, "acme", False)
    assert first.output_tokens == 3 and first.prompt_tokens == 9
    blob = row(3.0) + row(2.0)
    book.observe_header(StepHeader("prior", "prior/x", "0", 5.0, 0, True, carries_counts=True,
                                   aborted_joules=5.0, aborted_ids=("x", "elsewhere"),
                                   aborted_rows=blob).encode())
    booked = [r for r in rows[1:] if r.kind == "request"]
    engine = [r for r in rows[1:] if r.kind == "engine"]
    assert [(r.internal_id, r.outcome, r.tenant, r.later) for r in booked] == [
        ("x", "aborted", "acme", True)]
    assert booked[0].joules == pytest.approx(3.0) and booked[0].output_tokens is None
    assert [(r.outcome, r.joules) for r in engine] == [("aborted", pytest.approx(2.0))]
    assert math.fsum(r.joules for r in rows) == pytest.approx(
        registry.get_sample_value("piep_request_outcome_joules_total", {"outcome": "aborted"}))
    # A late output of it counts only what came after the booked row, as the aborted request's.
    book.late("x", StepHeader.decode(StepHeader("prior", "prior/x", "0", 0.0, 0, True).encode()),
              row(3.5))
    assert rows[-1].outcome == "unsent" and rows[-1].joules == pytest.approx(0.5)


def test_a_lone_surrogate_tenant_is_rejected_and_a_refused_row_never_blocks_the_rest(
        tmp_path) -> None:
    from vllm_piep.ledger import summary
    from vllm_piep.ledger.writer import LedgerWriter

    assert clean_tenant("ab\ud800c") == (None, True)
    dropped: list[int] = []
    writer = LedgerWriter(tmp_path / "l.db", flush_s=0.01, on_dropped=dropped.append)
    bad = LedgerRow("request", "finished", 1.0, 1.0, "prior", tenant="\ud800",
                    internal_id="bad")
    writer.put(bad)
    for i in range(5):
        writer.put(LedgerRow("request", "finished", 1.0, 1.0, "prior", internal_id=f"ok{i}"))
    writer.close()
    assert sum(dropped) == 1
    assert sorted(summary.read([tmp_path / "l.db"])["internal_id"]) == [f"ok{i}"
                                                                         for i in range(5)]
