"""examples/kubernetes/: the manifests parse, the container runs the command the README
documents (`vllm serve MODEL --plugins piep`), the Service, the ServiceMonitor and the plain
scrape job agree on the port and labels, and the dashboard ConfigMap holds
dashboards/grafana.json as it is. (No cluster here: nothing is applied.)"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "examples" / "kubernetes"


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((HERE / name).read_text()) if d]


def by_kind(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in documents(name)}


def readme_command() -> list[str]:
    """The README's documented way to serve with the plugin: `vllm serve MODEL --plugins piep`."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("vllm serve MODEL --plugins piep"):
            return shlex.split(line.split("#", 1)[0])
    raise AssertionError("the README documents no `vllm serve MODEL --plugins piep` line")


def test_the_container_runs_the_readme_s_command_on_a_gpu() -> None:
    deployment = by_kind("deployment.yaml")["Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    command = [*container["command"], *container["args"]]
    documented = readme_command()
    model = command[documented.index("MODEL")]
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", model), model  # a Hugging Face model id
    assert command[:len(documented)] == [model if t == "MODEL" else t for t in documented]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert command[command.index("--port") + 1] == str(port)
    assert container["readinessProbe"]["httpGet"]["port"] == "http"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_service_and_both_scrapes_reach_the_metrics_port() -> None:
    manifests = by_kind("deployment.yaml")
    service, deployment = manifests["Service"], manifests["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [port] = service["spec"]["ports"]
    assert port["name"] == "http" and port["targetPort"] == "http"
    monitor = by_kind("servicemonitor.yaml")["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    [job] = documents("prometheus-scrape.yaml")[0]["scrape_configs"]
    keep = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"]}
    assert keep[("__meta_kubernetes_service_name",)] == service["metadata"]["name"]
    assert keep[("__meta_kubernetes_endpoint_port_name",)] == port["name"]
    assert job["metrics_path"] == "/metrics"


def test_the_dashboard_configmap_is_the_dashboard_as_it_is() -> None:
    spec = importlib.util.spec_from_file_location("dashboard_configmap",
                                                  HERE / "dashboard_configmap.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert (HERE / "dashboard-configmap.yaml").read_text() == generator.render(), \
        "regenerate: python examples/kubernetes/dashboard_configmap.py"
    [configmap] = documents("dashboard-configmap.yaml")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    [text] = configmap["data"].values()
    assert json.loads(text) == json.loads((ROOT / "dashboards" / "grafana.json").read_text())


def test_the_dockerfile_installs_the_plugin_on_vllm_s_image() -> None:
    lines = [line for line in (HERE / "Dockerfile").read_text().splitlines()
             if line and not line.startswith("#")]
    assert lines[0].startswith("FROM vllm/vllm-openai:")
    assert any(line.startswith("RUN pip install") and "vllm-piep" in line for line in lines)
