"""Writes dashboard-configmap.yaml: the Grafana dashboard (dashboards/grafana.json) as a ConfigMap
that Grafana's dashboard sidecar (the kube-prometheus-stack chart's) loads by its label.

    python examples/kubernetes/dashboard_configmap.py
"""

from __future__ import annotations

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE.parents[1] / "dashboards" / "grafana.json"
OUT = HERE / "dashboard-configmap.yaml"
HEADER = ("# Generated from dashboards/grafana.json by dashboard_configmap.py beside this file:\n"
          "# Grafana's dashboard sidecar loads ConfigMaps labelled grafana_dashboard.\n")


def configmap() -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "vllm-piep-dashboard", "labels": {"grafana_dashboard": "1"}},
            "data": {"vllm-piep.json": DASHBOARD.read_text()}}


def render() -> str:
    return HEADER + yaml.safe_dump(configmap(), sort_keys=False, width=100)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
