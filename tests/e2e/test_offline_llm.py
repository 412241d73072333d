"""End to end, offline inference: `vllm.LLM(...).generate()` / `.chat()` on the tiny model, each
in its own process (tests/support/offline_llm.py). With the plugin on, every RequestOutput
carries `energy`, the record `vllm serve` puts in `usage.energy`, and the engine's step energy
is all in the outputs; with it off, outputs are vLLM's own."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.paths import ROOT

from vllm_piep.model.components import COMPONENTS
from vllm_piep.runtime.api_server.ledger import UsageEnergy
from vllm_piep.tools.server import held_shm, shm_entries

pytestmark = pytest.mark.server

SCRIPT = ROOT / "tests" / "support" / "offline_llm.py"
TIMEOUT_S = 900  # a start takes about a minute on 2 cores; more while other tests run


def run_offline(model: Path, workdir: Path, additional_config: dict | None = None,
                **env: str) -> dict[str, Any]:
    """Runs the script in its own session and private TMPDIR; removes the shared-memory
    entries it left (not those another process holds)."""
    workdir.mkdir(parents=True, exist_ok=True)
    # vLLM's zmq sockets live in TMPDIR, whose path must fit a Unix socket's 107 bytes: not
    # under pytest's temporary directory, which can be long.
    tmp = Path(tempfile.mkdtemp(prefix="piep-offline-"))
    out = workdir / "report.json"
    cmd = [sys.executable, str(SCRIPT), str(model), str(out)]
    if additional_config is not None:
        cmd += ["--additional-config", json.dumps(additional_config)]
    environ = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PIEP_ENABLED")}
    environ.update({"TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
                    "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **env})
    shm_before = shm_entries()
    log = workdir / "llm.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, env=environ, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT_S)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its engine core, if it lingers
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            shutil.rmtree(tmp, ignore_errors=True)
            for name in shm_entries() - shm_before - held_shm():
                if "vllm" in name or name.startswith(("psm_", "torch_", "sem.mp-")):
                    (Path("/dev/shm") / name).unlink(missing_ok=True)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert proc.returncode == 0 and out.exists(), f"offline run failed:\n{tail}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def run_in(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Callable[..., dict[str, Any]]:
    """One offline run per configuration, shared by the tests of this module."""
    runs: dict[str, dict[str, Any]] = {}

    def run(name: str, additional_config: dict | None = None, **env: str) -> dict[str, Any]:
        if name not in runs:
            runs[name] = run_offline(tiny_model, tmp_path_factory.mktemp(f"offline_{name}"),
                                     additional_config, **env)
        return runs[name]

    return run


def env_enabled(run_in: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    return run_in("env", VLLM_PLUGINS="piep")  # engine core in a child process (the default)


def config_enabled(run_in: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    # VLLM_PLUGINS unset (every installed plugin loads); the engine core in this process.
    return run_in("config", {"piep": {"carbon_intensity": 400.0}},
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")


def check_record(output: dict[str, Any]) -> UsageEnergy:
    assert output["finished"] and output["has_energy"], output
    energy = UsageEnergy(**output["energy"])
    assert energy.joules > 0
    assert energy.prefill_joules > 0 and energy.decode_joules > 0
    assert energy.joules == pytest.approx(energy.prefill_joules + energy.decode_joules,
                                          rel=1e-9)
    assert set(energy.breakdown) == set(COMPONENTS)
    assert math.fsum(energy.breakdown.values()) == pytest.approx(energy.joules, rel=1e-9)
    assert energy.joules_per_output_token == pytest.approx(
        energy.joules / output["completion_tokens"], rel=1e-12)
    assert energy.source == "prior" and energy.bundle.startswith("prior")
    assert output["records"] == output["samples"]  # one request per sample, each taken once
    return energy


@pytest.mark.parametrize("enabled", [env_enabled, config_enabled], ids=["VLLM_PLUGINS",
                                                                       "additional_config"])
def test_every_output_carries_its_energy_record(run_in, enabled) -> None:
    report = enabled(run_in)
    outputs = report["outputs"]
    assert [o["kind"] for o in outputs] == ["generate"] * 4 + ["n3", "chat"]
    energies = [check_record(o) for o in outputs]
    plain = energies[:4]
    # Longer generations (same prompt length) decode for more steps.
    assert [e.decode_joules for e in plain] == sorted(e.decode_joules for e in plain)
    assert plain[-1].decode_joules > plain[0].decode_joules
    n3 = outputs[4]
    assert n3["samples"] == 3 and n3["completion_tokens"] == 15


def test_the_engines_step_energy_is_all_in_the_outputs(run_in) -> None:
    for report in (env_enabled(run_in), config_enabled(run_in)):
        returned = math.fsum(o["energy"]["joules"] for o in report["outputs"])
        counters = report["counters"]
        assert counters["piep_request_outcome_joules_total/finished"] == pytest.approx(
            returned, rel=1e-9)
        elsewhere = math.fsum(counters.get(f"piep_request_outcome_joules_total/{outcome}", 0.0)
                              for outcome in ("after_finish", "unsent", "warmup"))
        assert counters["piep_engine_step_joules_total/"] == pytest.approx(
            returned + elsewhere, rel=1e-9)


def test_nothing_stays_in_the_ledger_after_generate_returns(run_in) -> None:
    for report in (env_enabled(run_in), config_enabled(run_in)):
        assert report["ledger"] == {"open_closed": [0, 0], "claimed": 0}


def test_plugin_options_from_additional_config_reach_the_records(run_in) -> None:
    for output in config_enabled(run_in)["outputs"]:
        energy = UsageEnergy(**output["energy"])
        # 400 gCO2e/kWh: J / 3.6e6 * 400
        assert energy.gco2e == pytest.approx(energy.joules / 3.6e6 * 400.0, rel=1e-9)
    assert all(o["energy"]["gco2e"] is None for o in env_enabled(run_in)["outputs"])


def test_without_the_plugin_outputs_carry_no_energy(run_in) -> None:
    # The plugin loads (VLLM_PLUGINS unset) but nobody asked for it; the engine core in this
    # process (a start without two more interpreters: the check is the same in either layout).
    report = run_in("off", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    assert len(report["outputs"]) == 6
    assert not any(o["has_energy"] for o in report["outputs"])
    assert report["ledger"] is None


def test_the_documented_snippet_runs_as_a_script(tiny_model: Path, tmp_path: Path) -> None:
    """docs/offline.md's snippet (the README links it), saved as a file and run as `python
    snippet.py` with the tiny model for MODEL: it runs (vLLM's CPU build starts its engine with
    spawn, which re-imports the script) and prints the request's energy."""
    from support.doc_blocks import blocks

    snippet = [b for b in blocks(ROOT, [ROOT / "docs" / "offline.md"]) if b.lang == "python"][0]
    script = tmp_path / "snippet.py"
    # Eager: compiling the tiny model's graph doubles the run on 2 cores and tests vLLM, not
    # the snippet.
    assert 'LLM(model="MODEL", ' in snippet.text
    script.write_text(snippet.text.replace('"MODEL"', f"{str(tiny_model)!r}, enforce_eager=True"))
    # vLLM's zmq sockets live in TMPDIR, whose path must fit a Unix socket's 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="piep-snippet-"))
    environ = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PIEP_ENABLED")}
    environ.update({"TMPDIR": str(tmp), "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    try:
        done = subprocess.run([sys.executable, str(script)], env=environ, cwd=tmp_path,
                              capture_output=True, text=True, timeout=TIMEOUT_S,
                              start_new_session=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if "'breakdown'" in line]
    assert len(printed) == 1, done.stdout[-2000:]  # vLLM's log shares stdout
    joules, _, usage = printed[0].partition(" ")
    assert float(joules) > 0 and usage.startswith("{'joules': "), printed
