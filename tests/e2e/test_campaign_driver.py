"""The campaign driver (`python -m vllm_piep.calibrate run`, profiling half) on a real vLLM with
the tiny model: a whole campaign, one interrupted by Ctrl-C, one whose engine is killed and
which `--resume` then finishes (its server-free parts: tests/unit/calibrate/test_campaign_plan.py).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from rich.console import Console
from support.paths import ROOT

from vllm_piep.calibrate.campaign import (
    STATE_FILE,
    CampaignError,
    CampaignPlan,
    CampaignState,
    run_campaign,
)
from vllm_piep.meters.log import read_meter_log
from vllm_piep.spans.reader import SpanSet, span_files
from vllm_piep.tools.server import held_shm, shm_entries

CELLS = ["b1-o4", "b1-o16", "b2-o4", "b2-o16"]


def grid_plan(model: Path) -> CampaignPlan:
    """The quick preset (with its repeated sampling) on one config and four cells. Each cell
    takes a second or two (sampled steps replay every module for 2 x 0.06 s): time enough to
    interrupt or crash the campaign between two cells."""
    quick = CampaignPlan.quick(str(model)).model_dump()
    return CampaignPlan(**{**quick, "tp": [1], "batch": [1, 2], "out_len": [4, 16],
                           "max_model_len": None,
                           "sampling": {"windows": 2, "min_window_s": 0.03, "every": 8}})


def quiet() -> Console:
    return Console(file=io.StringIO(), width=120, force_terminal=False)


def read_state(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def leftover_shm(before: set[str], settle_s: float = 30.0) -> set[str]:
    """New /dev/shm entries that no running process holds: left behind. Entries that running
    processes hold belong to whatever else runs here (another test session's vLLM); so do,
    for a moment, those of a vLLM stopping beside this test, held by no one until its resource
    tracker removes them: what is left is read again until it is empty or `settle_s` has gone
    by (an entry this test's servers left stays, and is returned)."""
    deadline = time.monotonic() + settle_s
    while (left := shm_entries() - before - held_shm()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def left_of(held: set[str]) -> set[str]:
    """Which of the /dev/shm entries that a stopped server's processes `held` while they ran
    are still there. Only those: a vLLM stopping beside this test leaves its own entries for a
    moment, held by no one, until its resource tracker removes them."""
    return held & shm_entries()


def group_processes(pgid: int) -> list[psutil.Process]:
    """Live (not zombie) processes of a process group."""
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def still_running(snapshot: list[tuple[int, float]]) -> list[int]:
    """The processes of a (pid, create_time) snapshot that still run (pid reuse excluded)."""
    alive = []
    for pid, created in snapshot:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def descendants(pid: int) -> list[tuple[int, float]]:
    return [(c.pid, c.create_time()) for c in psutil.Process(pid).children(recursive=True)]


def workload(cell: dict[str, Any]) -> tuple[int, ...]:
    return tuple(cell[k] for k in ("batch", "out_len", "requests", "prompt_tokens",
                                   "completion_tokens"))


# --------------------------------------------------------------------------------------------
# A whole campaign


@dataclass
class Finished:
    plan: CampaignPlan
    out: Path
    state: CampaignState
    console_text: str
    new_shm: set[str]  # /dev/shm entries that the campaign left behind


@pytest.fixture(scope="module")
def whole(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Finished:
    plan, out, console = grid_plan(tiny_model), tmp_path_factory.mktemp("campaign") / "out", quiet()
    shm_before = shm_entries()
    state = run_campaign(plan, out, console=console)
    return Finished(plan, out, state, console.file.getvalue(), leftover_shm(shm_before))


@pytest.mark.server
def test_a_whole_campaign_records_every_cell_with_its_tokens(whole: Finished) -> None:
    plan, out, state, text = whole.plan, whole.out, whole.state, whole.console_text
    saved = read_state(out)
    assert saved is not None and saved["schema"] == "piep.campaign/1" and saved["finished"]
    assert saved["plan"] == plan.model_dump() and saved["plan"]["max_model_len"] == 24 + 16 + 16
    assert list(saved["configs"]) == ["tp1-pp1"]
    config = saved["configs"]["tp1-pp1"]
    assert config["done"] and sorted(config["cells"]) == sorted(CELLS)
    for name, cell in config["cells"].items():
        b, o = cell["batch"], cell["out_len"]
        assert name == f"b{b}-o{o}" and cell["attempt"] == 1 and cell["requests"] == b
        assert cell["prompt_tokens"] == b * 24 and cell["completion_tokens"] == b * o
        assert cell["start_ns"] < cell["end_ns"]
    assert [a["attempt"] for a in config["attempts"]] == [1]
    assert config["attempts"][0]["outcome"] == "completed"
    assert (config["attempts"][0]["meter"], config["attempts"][0]["meter_source"]) == \
        ("cpu-estimate", "estimated")
    assert state.finished and set(state.configs["tp1-pp1"].cells) == set(CELLS)
    assert "tp1-pp1: starting vLLM (attempt 1)..." in text
    assert "meter: cpu-estimate (estimated)" in text
    assert whole.new_shm == set()


@pytest.mark.server
def test_the_attempt_holds_idle_window_meter_log_and_spans_on_one_clock(whole: Finished
                                                                       ) -> None:
    out, state = whole.out, whole.state
    attempt = out / "runs" / "tp1-pp1" / "attempt-1"
    assert state.configs["tp1-pp1"].attempts[0].dir == "runs/tp1-pp1/attempt-1"
    idle = json.loads((attempt / "idle.json").read_text())
    assert whole.plan.idle_s <= idle["seconds"] < whole.plan.idle_s + 0.5
    assert idle["end_ns"] - idle["start_ns"] == pytest.approx(idle["seconds"] * 1e9, abs=1)
    cells = sorted(state.configs["tp1-pp1"].cells.values(), key=lambda c: c.start_ns)
    assert idle["end_ns"] <= cells[0].start_ns  # no request during the idle window
    for before, after in zip(cells, cells[1:], strict=False):
        assert before.end_ns <= after.start_ns  # one cell at a time
    header, readings = read_meter_log(attempt / "meter.jsonl")
    assert (header.meter, header.source, header.extra["config"]) == \
        ("cpu-estimate", "estimated", "tp1-pp1")
    # The log covers the whole attempt: from before the idle window to after the last cell.
    assert readings[0].t_ns < idle["start_ns"] and readings[-1].t_ns > cells[-1].end_ns
    files = span_files(attempt / "spans")
    assert files and all(f.stat().st_size > 0 for f in files)
    spans = SpanSet.read(files)
    steps = spans.steps
    for cell in cells:
        inside = steps[(steps["start_ns"] >= cell.start_ns) & (steps["end_ns"] <= cell.end_ns)]
        # decode steps of the cell's requests: at least out_len - 1 of them
        assert len(inside) >= cell.out_len - 1, (cell, len(inside))
    # The plan's sampling options reached the workers: two replay windows per sampled module.
    assert len(spans.samples) > 0 and set(spans.samples["window"]) == {0, 1}
    assert "Application startup complete" in (attempt / "server.log").read_text()


@pytest.mark.server
def test_a_finished_campaign_is_not_rerun_and_not_overwritten(whole: Finished) -> None:
    plan, out, state = whole.plan, whole.out, whole.state
    with pytest.raises(CampaignError, match="use --resume"):
        run_campaign(plan, out, console=quiet())
    again = run_campaign(plan, out, resume=True, console=quiet())  # nothing left: no server
    assert again.configs["tp1-pp1"].attempts == state.configs["tp1-pp1"].attempts
    assert again.configs == state.configs and again.finished
    assert not (out / "runs" / "tp1-pp1" / "attempt-2").exists()


# --------------------------------------------------------------------------------------------
# Ctrl-C

DRIVER = """
import json, sys
from pathlib import Path
from rich.console import Console
from vllm_piep.calibrate.campaign import CampaignPlan, run_campaign
run_campaign(CampaignPlan(**json.loads(sys.argv[1])), Path(sys.argv[2]),
             console=Console(width=120))
"""


@pytest.mark.server
def test_ctrl_c_stops_everything_and_leaves_a_resumable_state(tiny_model: Path,
                                                              tmp_path: Path) -> None:
    plan, out = grid_plan(tiny_model), tmp_path / "out"
    with open(tmp_path / "driver.log", "wb") as log:
        # SIGINT at its default in the driver even when these tests run as a background job
        # (which starts with SIGINT ignored, and children inherit that).
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, plan.model_dump_json(), str(out)],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        def some_cells_done() -> dict[str, Any] | None:
            state = read_state(out)
            assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            return state if state and state["configs"]["tp1-pp1"]["cells"] else None

        wait_for(some_cells_done, 300, "the first finished cell")
        running = descendants(proc.pid)
        assert running, "the driver runs vLLM in child processes"
        held = held_shm({pid for pid, _ in running})
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        t0 = time.monotonic()
        returncode = proc.wait(timeout=60)
        stop_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    interrupted = read_state(out)
    assert interrupted is not None
    config = interrupted["configs"]["tp1-pp1"]
    assert returncode != 0 and stop_s < 60
    assert 1 <= len(config["cells"]) < len(CELLS), config["cells"]
    assert not config["done"] and not interrupted["finished"]
    assert config["attempts"][0]["outcome"] == "interrupted"
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # the driver's session is empty
    server_pid = config["attempts"][0]["server_pid"]
    assert group_processes(server_pid) == [] and still_running(running) == []
    assert left_of(held) == set(), held
    # What `--resume` reads: the plan and the finished cells (a resume after a stopped attempt
    # is run below, after a killed engine).
    assert interrupted["plan"] == plan.model_dump()
    assert set(CampaignState.load(out / STATE_FILE).configs["tp1-pp1"].cells) == \
        set(config["cells"])


def resume_finishes_the_same_cells(plan: CampaignPlan, out: Path, stopped: dict[str, Any],
                                   whole: Finished) -> None:
    """`--resume` after a stopped attempt: a second attempt measures only the cells missing,
    and the campaign ends as the uninterrupted one did (same cells, work and dataset)."""
    shm_before = shm_entries()
    config = stopped["configs"]["tp1-pp1"]
    resumed = run_campaign(plan, out, resume=True, console=quiet())
    cells = resumed.configs["tp1-pp1"].cells
    assert resumed.finished and [a.attempt for a in resumed.configs["tp1-pp1"].attempts] == [1, 2]
    assert (out / "runs" / "tp1-pp1" / "attempt-2" / "idle.json").exists()
    for name, before in config["cells"].items():
        assert cells[name].model_dump() == before  # kept, not measured again
    assert {cells[n].attempt for n in set(CELLS) - set(config["cells"])} == {2}
    reference = whole.state.configs["tp1-pp1"].cells
    assert sorted(cells) == sorted(reference)
    assert {n: workload(c.model_dump()) for n, c in cells.items()} == \
        {n: workload(c.model_dump()) for n, c in reference.items()}
    assert leftover_shm(shm_before) == set()
    assert dataset_signature(out) == dataset_signature(whole.out)


def dataset_signature(out: Path) -> dict[str, Any]:
    """What must not depend on an interruption: which cells and steps' work the dataset holds
    (tokens computed per cell), the tree of every step, the features, the replayed nodes.
    (Timings and energies are measurements: they differ from run to run.)"""
    from vllm_piep.calibrate.campaign_data import build_campaign_data

    data = build_campaign_data(out, json.loads((out / STATE_FILE).read_text()))
    ds = data.dataset
    roots = ds.nodes[ds.nodes.parent_id == ""].merge(ds.trees[["tree_id", "group"]])
    return {
        "issues": ds.issues,
        "work": roots.groupby("group")[["prefill_tokens", "decode_tokens"]].sum().to_dict(),
        "trees": sorted({tuple(sorted(g.node_id)) for _, g in ds.nodes.groupby("tree_id")}),
        "features": ds.features,
        "replayed nodes": sorted(set(data.samples.node_id.dropna())),
    }


# --------------------------------------------------------------------------------------------
# vLLM dies mid-campaign


def engine_process(server_pid: int) -> psutil.Process:
    """The engine core: vLLM names its processes `VLLM::EngineCore`, `VLLM::Worker...`."""
    children = psutil.Process(server_pid).children(recursive=True)
    engines = [c for c in children if "EngineCor" in c.name()]
    assert engines, [(c.pid, c.name()) for c in children]
    return engines[0]


@pytest.mark.server
def test_a_killed_engine_stops_the_campaign_and_resume_finishes_it(
        whole: Finished, tiny_model: Path, tmp_path: Path) -> None:
    plan, out = grid_plan(tiny_model), tmp_path / "out"
    outcome: dict[str, BaseException] = {}

    def campaign() -> None:
        try:
            run_campaign(plan, out, console=quiet())
        except BaseException as exc:  # noqa: BLE001  (handed to the test thread)
            outcome["error"] = exc

    thread = threading.Thread(target=campaign, daemon=True)
    thread.start()
    state = wait_for(lambda: (s := read_state(out)) and s["configs"]["tp1-pp1"]["cells"] and s,
                     300, "the first finished cell")
    server_pid = state["configs"]["tp1-pp1"]["attempts"][0]["server_pid"]
    running = descendants(server_pid)
    held = held_shm({pid for pid, _ in running} | {server_pid})
    engine_process(server_pid).kill()  # SIGKILL
    thread.join(timeout=120)
    assert not thread.is_alive()
    error = outcome.get("error")
    assert isinstance(error, CampaignError), repr(error)
    message = str(error)
    assert message.startswith("tp1-pp1, attempt 1, cell b") and "--resume" in message
    log_tail = message.split("server.log when it failed:\n", 1)[1]
    assert "(APIServer pid=" in log_tail  # vLLM's own lines, from the attempt's log
    crashed = read_state(out)
    assert crashed is not None
    config = crashed["configs"]["tp1-pp1"]
    assert 1 <= len(config["cells"]) < len(CELLS) and not config["done"]
    assert config["attempts"][0]["outcome"] == "failed"
    assert group_processes(server_pid) == [] and still_running(running) == []
    assert left_of(held) == set(), held
    resume_finishes_the_same_cells(plan, out, crashed, whole)


# --------------------------------------------------------------------------------------------
# Refused without starting a server
