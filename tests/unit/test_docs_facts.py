"""One statement per fact: the facts users look up (the response's `source` values, the outcomes
of /metrics, which meter serves, AMD support) are described in one document each, checked here
against the code that holds them, and not restated elsewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.paths import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def text(name: str) -> str:
    return (ROOT / name).read_text()


def table_row(document: str, first_cell: str) -> str:
    [row] = [line for line in document.splitlines() if line.startswith(f"| {first_cell} |")]
    return row


def test_the_response_sources_are_described_once_and_are_the_codes() -> None:
    from vllm_piep.runtime.record import RESPONSE_SOURCES

    row = table_row(text("docs/architecture.md"), "`source`")
    described = re.findall(r"`([a-z]+)`", row.split("|")[2])
    assert set(described) == set(RESPONSE_SOURCES), (described, RESPONSE_SOURCES)
    # Elsewhere a source is named by reference, never listed as the whole set differently.
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            assert "`corrected`" not in line, f"{doc.name}: {line}"


def test_the_outcomes_are_described_once_and_are_the_codes() -> None:
    from vllm_piep.runtime.api_server.metrics import OUTCOMES

    billing = text("docs/billing.md")
    section = billing.split("## What to bill: outcomes", 1)[1].split("\n## ", 1)[0]
    described = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE)
    assert described == list(OUTCOMES)
    pattern = re.compile(rf"^\| `({'|'.join(OUTCOMES)})` \|", flags=re.MULTILINE)
    for doc in DOCS:  # no second table of them
        if doc.name != "billing.md":
            assert not pattern.search(doc.read_text()), f"{doc.name} describes an outcome again"


def test_which_meter_serves_is_stated_once() -> None:
    meters = text("docs/meters.md")
    section = meters.split("## Which meter serves", 1)[1].split("\n## ", 1)[0]
    auto = next(line for line in section.split("\n- ") if line.startswith("**`auto`**"))
    order = [name for name in ("NVML", "AMD SMI", "RAPL", "the CPU estimate") if name in auto]
    assert order == sorted(order, key=auto.index) == ["NVML", "AMD SMI", "RAPL",
                                                       "the CPU estimate"]
    for doc in DOCS:
        if doc.name != "meters.md":
            body = doc.read_text()
            assert not re.search(r"NVML[^.]{0,40}, (?:then|else) (?:AMD SMI|RAPL)", body), (
                f"{doc.name} restates the meter chain: link meters.md#which-meter-serves")


def test_auto_follows_the_documented_order(tmp_path: Path) -> None:
    from vllm_piep.meters.auto import auto_meter
    from vllm_piep.meters.simulated import SimulatedMeter

    def pick(nvml: bool, amd: bool) -> str:
        meter, _ = auto_meter(nvml_factory=SimulatedMeter, nvml_available=nvml,
                              amd_factory=SimulatedMeter, amd_available=amd,
                              rapl_root=tmp_path / "no-powercap")
        return "gpu" if isinstance(meter, SimulatedMeter) else meter.name

    assert pick(True, True) == "gpu" and pick(False, True) == "gpu"
    assert pick(False, False) == "cpu-estimate"  # no RAPL here: the last link


def test_no_document_says_amd_gpus_are_not_metered() -> None:
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            assert not re.search(r"AMD[^.]*not metered", line), f"{doc.name}: {line}"


def test_the_readme_is_short_and_its_example_is_what_the_demo_serves(shape) -> None:
    """The README's `usage.energy` is the demo's (`scripts/demo.sh`: the tiny model in float32,
    `bundle: auto`): the same bundle and source as the predictor the demo's server builds, and
    the contract's invariants to the example's rounding."""
    import json

    from vllm_piep.config import PiepConfig
    from vllm_piep.model.components import COMPONENTS
    from vllm_piep.predict.loader import load_predictor
    from vllm_piep.tools.demo import DEFAULT_BUNDLE

    readme = text("README.md")
    assert len(readme.encode()) < 12 * 1024
    block = readme.split("```json\n", 1)[1].split("```", 1)[0]
    usage = json.loads("{" + block + "}")["usage"]
    energy = usage["energy"]
    predictor = load_predictor(PiepConfig(bundle=DEFAULT_BUNDLE), shape, "cpu", None,
                               "LlamaForCausalLM")
    assert (energy["bundle"], energy["source"]) == (predictor.bundle_id, predictor.source)
    assert list(energy["breakdown"]) == list(COMPONENTS)
    joules = energy["joules"]
    assert sum(energy["breakdown"].values()) == pytest.approx(joules, rel=2e-3)
    assert energy["prefill_joules"] + energy["decode_joules"] == pytest.approx(joules, rel=2e-3)
    assert energy["joules_per_output_token"] * usage["completion_tokens"] == pytest.approx(
        joules, rel=2e-3)


def test_the_readme_says_what_the_test_command_takes_and_needs() -> None:
    """`scripts/test.sh` starts vLLM servers and measures this machine's energy: the README says
    to run it on an idle machine, and how long it takes as docs/benchmarks.md's summary
    recorded its latest whole run."""
    readme = text("README.md")
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    latest = re.search(r"^\| The whole suite[^|]*\| (?:met|\*\*missed\*\*): (\d+) min",
                       text("docs/benchmarks.md"), flags=re.MULTILINE)
    assert latest, "docs/benchmarks.md's summary has no run time of the whole suite"
    assert f"about {latest.group(1)} min on 2 cores" in section
    assert "servers two at a time" in section and "idle machine" in section
    assert "benchmarks.md#the-test-suites-run-time" in section
    assert "## The test suite's run time" in text("docs/benchmarks.md")


def test_serving_without_a_meter_never_takes_the_cpu_estimate_in_any_document() -> None:
    """With `meter` unset a CPU server takes RAPL or no meter (docs/meters.md); the README's
    hardware table says the estimate serves only where `meter` asks for it."""
    from vllm_piep.meters.common import NoMeter
    from vllm_piep.meters.factory import meter_factory

    row = table_row(text("README.md"), "x86-64 CPU")
    assert "RAPL" in row and "only if `meter` asks" in row
    assert not re.search(r"RAPL, else (?:an|the CPU) estimate", row)
    factory, _ = meter_factory("auto", None, measuring_only=True)  # what `meter` unset runs
    try:
        meter = factory()
    except NoMeter:
        return  # no RAPL here: prediction mode, never the estimate
    assert meter.source == "measured", meter.name
