"""examples/kubernetes/: the manifests parse, the container runs the command the README
documents (`vllm serve MODEL --plugins piep`), the Service, the ServiceMonitor and the plain
scrape job agree on the port and labels, and the dashboard ConfigMap holds
dashboards/grafana.json as it is. The Dockerfile builds from the repository root: it copies
every path the package's build reads (pyproject.toml, its readme, the packages setuptools finds
and their package data), the root's .dockerignore lets exactly those in, it installs what it
copied, and every documented `docker build` names the repository root as the context. (No
cluster and no Docker here: nothing is applied or built.)"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "examples" / "kubernetes"
DOCKERFILE = HERE / "Dockerfile"
DOCKERFILE_FROM_ROOT = DOCKERFILE.relative_to(ROOT).as_posix()


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


def instructions() -> list[list[str]]:
    """The Dockerfile's instructions as words (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [shlex.split(line) for line in text.splitlines() if line.strip()]


def copies() -> dict[str, str]:
    """Each COPY source (relative to the build context) and where it lands in the image."""
    landed: dict[str, str] = {}
    for words in instructions():
        if words[0] == "COPY":
            assert not any(w.startswith("--") for w in words), words  # from the context only
            *sources, dest = words[1:]
            assert len(sources) == 1 or dest.endswith("/"), words
            for source in sources:
                landed[source] = dest + Path(source).name if dest.endswith("/") else dest
    return landed


def build_reads() -> dict[str, list[Path]]:
    """What `pip install` of the package reads, by top-level path of the repository:
    pyproject.toml, its readme, and each package setuptools finds with its package data."""
    from setuptools import find_namespace_packages, find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool = config["tool"]["setuptools"]
    find = dict(tool["packages"]["find"])
    finder = find_namespace_packages if find.pop("namespaces", True) else find_packages
    packages = finder(where=str(ROOT / find.pop("where", ".")), **find)
    readme = config["project"]["readme"]
    reads: dict[str, list[Path]] = {"pyproject.toml": [ROOT / "pyproject.toml"],
                                    readme: [ROOT / readme]}
    for package in packages:
        folder = ROOT.joinpath(*package.split("."))
        reads.setdefault(package.split(".")[0], []).extend(folder.glob("*.py"))
    for package, patterns in tool.get("package-data", {}).items():
        for pattern in patterns:
            files = [f for f in ROOT.joinpath(*package.split(".")).glob(pattern) if f.is_file()]
            assert files, f"package-data {package}: {pattern} matches nothing"
            reads[package.split(".")[0]].extend(files)
    return reads


def test_the_dockerfile_installs_the_plugin_on_vllm_s_image() -> None:
    found = instructions()
    assert found[0][0] == "FROM" and found[0][1].startswith("vllm/vllm-openai:")
    assert any(w[:3] == ["RUN", "pip", "install"] for w in found)


def test_the_image_copies_every_path_the_package_build_reads() -> None:
    landed = copies()
    for source in landed:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    reads = build_reads()
    assert sorted(landed) == sorted(reads), "COPY exactly what `pip install .` reads"
    assert reads["vllm_piep"] and reads["kernels_trace"]
    # The copies keep the repository's layout under one folder, the one pip installs.
    [source_dir] = {str(Path(dest).parent) for dest in landed.values()}
    assert all(Path(dest).name == Path(source).name for source, dest in landed.items())
    [install] = [w for w in instructions() if w[:3] == ["RUN", "pip", "install"]]
    assert "--no-cache-dir" in install
    targets = [w for w in install[3:] if not w.startswith("-")]
    assert [t.rstrip("/") for t in targets] == [source_dir], install  # no extra, no index name


def test_the_build_context_lets_in_exactly_what_the_dockerfile_copies() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert patterns[0] == "*"  # everything out, then what the image needs back in
    let_in = [p.removeprefix("!") for p in patterns if p.startswith("!")]
    assert sorted(let_in) == sorted(copies())
    assert not {".venv", ".cache", ".git", "data", "tests", "benchmarks"} & set(let_in)
    # The other patterns (caches) drop nothing the build reads.
    dropped = [p for p in patterns[1:] if not p.startswith("!")]
    for pattern in dropped:
        assert pattern.startswith("**/") and "/" not in pattern[3:], pattern
    for files in build_reads().values():
        for f in files:
            parts = f.relative_to(ROOT).parts
            hit = [p for p in dropped if any(fnmatch(part, p[3:]) for part in parts)]
            assert not hit, (f, hit)


def docker_builds() -> list[tuple[str, list[str]]]:
    """Every documented `docker build`: the Dockerfile's header and the Markdown users read."""
    sources = [DOCKERFILE, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
               *sorted((ROOT / "examples").glob("**/README*.md"))]
    found = []
    for path in sources:
        for line in path.read_text().splitlines():
            command = line.lstrip("# ").split("&&")[0]
            if command.startswith("docker build"):
                found.append((str(path.relative_to(ROOT)), shlex.split(command)[2:]))
    return found


def test_every_documented_build_has_the_repository_root_as_its_context() -> None:
    builds = docker_builds()
    assert {where for where, _ in builds} >= {DOCKERFILE_FROM_ROOT, "examples/kubernetes/README.md"}
    with_value = {"-f", "--file", "-t", "--tag", "--build-arg", "--platform", "--target"}
    for where, words in builds:
        positional, options = [], {}
        it = iter(words)
        for word in it:
            if word in with_value:
                options[word] = next(it)
            elif not word.startswith("-"):
                positional.append(word)
        assert positional == ["."], (where, words)  # run from the repository root
        assert options.get("-f", options.get("--file")) == DOCKERFILE_FROM_ROOT, (where, words)
