"""The PromQL queries of `dashboards/grafana.json` and the metric names they use."""

from __future__ import annotations

import json
import re
from typing import Any

from support.paths import ROOT

DASHBOARD = ROOT / "dashboards" / "grafana.json"
METRIC = re.compile(r"\b(piep_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict[str, Any] | None = None) -> list[str]:
    return [t["expr"] for p in (dash or dashboard())["panels"] for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def dashboard_metrics() -> set[str]:
    return {m for q in queries() for m in metric_names(q)}
