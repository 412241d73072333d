"""`dashboards/grafana.json`: a dashboard Grafana can import, every query well formed and naming
only metrics the plugin's code registers (or vLLM's token counters). That a real server exports
them all is checked on a live server in `tests/e2e/test_measured_e2e.py`."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry
from support.grafana import dashboard, dashboard_metrics, metric_names, queries

from vllm_piep.runtime.api_server.meter_sampler import MeterSampler
from vllm_piep.runtime.api_server.metrics import EnergyMetrics

VLLM_TOKEN_COUNTERS = {"vllm:generation_tokens_total", "vllm:prompt_tokens_total"}


def registered_names() -> set[str]:
    """The sample names the plugin's collectors export (a counter `x` as `x_total`)."""
    registry = CollectorRegistry()
    EnergyMetrics(registry)
    MeterSampler(lambda: None, "test", registry=registry)  # type: ignore[arg-type, return-value]
    names = set()
    for family in registry.collect():
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_the_dashboard_is_importable() -> None:
    dash = dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys(), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
    variables = {v["name"] for v in dash["templating"]["list"]}
    used = {m for q in queries(dash) for m in re.findall(r"\$(\w+)", q)}
    assert used - {"__rate_interval", "__range"} <= variables


@pytest.mark.parametrize("expr", queries(dashboard()))
def test_every_query_is_balanced_and_names_a_metric(expr: str) -> None:
    assert metric_names(expr), expr
    for left, right in ("()", "{}", "[]"):
        depth = 0
        for ch in expr:
            depth += (ch == left) - (ch == right)
            assert depth >= 0, expr
        assert depth == 0, expr
    assert expr.count('"') % 2 == 0, expr


def test_every_metric_a_query_names_is_registered() -> None:
    unknown = dashboard_metrics() - registered_names() - VLLM_TOKEN_COUNTERS
    assert not unknown, f"the dashboard names metrics no collector registers: {sorted(unknown)}"


def test_the_dashboard_covers_every_energy_counter() -> None:
    """A counter added to the plugin without a panel shows up here."""
    missing = {n for n in registered_names() if n.endswith("_total")} - dashboard_metrics()
    assert not missing, f"no panel shows {sorted(missing)}"
