"""The check's runner: each section in a process of its own, under its time budget; each
section's JSON as it ends; the summary last.

The parent (`run_all`) starts `ENTRY --section NAME` per section, its output appended to the
log; a section past its budget is killed with its process group and reported `timeout` with
the figures it had written; a section whose process dies is reported `error`. The child
(`run_section`) runs the section's function and writes its verdict: `skipped` with one line
when it cannot run here (no GPU, no NVML, a MIG instance), `error` with one line when it
raised (an out-of-memory model, a counter that never advances), else `passed` or `failed` by
its criteria.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vllm_piep.tools.gpu_check.backend import Backend
from vllm_piep.tools.gpu_check.context import Context
from vllm_piep.tools.gpu_check.report import FAILING, SectionReport, SectionSkipped, one_line
from vllm_piep.tools.server import stop_group

LOG_NAME = "gpu-check.log"
SUMMARY_NAME = "summary.json"


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    budget_s: float
    function: str  # module:function, run with a Context


SECTIONS = (
    Section("environment", "Environment", 30, "environment:run"),
    Section("nvml", "NVML meter", 60, "nvml_section:run"),
    Section("step_clock", "CUDA-event step clock", 40, "step_clock:run"),
    Section("prior", "The prior against the GPU's energy", 170, "prior_section:run"),
    Section("measured", "Measured mode on a real counter", 70, "measured_section:run"),
    Section("kernels", "kernels_trace on a real trace", 60, "kernels_section:run"),
)
BY_NAME = {s.name: s for s in SECTIONS}


def section_path(out: Path, name: str) -> Path:
    return out / f"{name}.json"


def imported_distributions() -> dict[str, list[str]]:
    """The top-level modules this process imported from installed distributions, each with
    the distributions that provide it (a namespace such as `google` has several): what a
    machine without network must already have, or be carried."""
    from importlib import metadata

    owners = metadata.packages_distributions()
    tops = {name.partition(".")[0] for name in list(sys.modules)}
    return {top: sorted(set(owners[top])) for top in sorted(tops) if top in owners}


def run_section(name: str, out: Path, make_backend: Callable[[], Backend], dry_run: bool
                ) -> int:
    """The child: one section, its JSON written whatever happens."""
    section = BY_NAME[name]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    report = SectionReport(name, section.title, section_path(out, name), dry_run)
    report.write()
    try:
        backend = make_backend()
        module_name, _, function = section.function.partition(":")
        run = getattr(importlib.import_module(f"vllm_piep.tools.gpu_check.{module_name}"),
                      function)
        with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as scratch:
            run(Context(report, backend, Path(scratch)))
        status, reason = None, None
    except SectionSkipped as exc:
        status, reason = "skipped", str(exc)
    except Exception as exc:  # noqa: BLE001  (the section's error, said in one line)
        traceback.print_exc()
        status, reason = "error", one_line(exc)
        if "OutOfMemoryError" in type(exc).__name__:
            reason = "out of GPU memory: " + reason
    report.data["imported_distributions"] = imported_distributions()
    final = report.finish(status, reason)  # type: ignore[arg-type]
    print(f"section {name}: {final}" + (f" ({report.data['reason']})"
                                        if report.data["reason"] else ""), file=sys.stderr)
    return 0


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_child(section: Section, out: Path, child: list[str], log: Any, budget: float
              ) -> dict[str, Any]:
    """One section's process under its budget (s); its result, as written or as found."""
    path = section_path(out, section.name)
    path.unlink(missing_ok=True)
    started = time.monotonic()
    log.flush()
    process = subprocess.Popen([*child, "--section", section.name, "--out", str(out)],
                               stdout=log, stderr=log, start_new_session=True)
    try:
        code = process.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        stop_group(process, ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)))
        code = None
    elapsed = time.monotonic() - started
    data = _read(path) or {"section": section.name, "title": section.title, "figures": {},
                           "criteria": [], "complete": False}
    if code is None:
        data.update(status="timeout", complete=False,
                    reason=f"ran out of its {budget:.0f} s budget (figures so far kept)")
    elif not data.get("complete"):
        data.update(status="error", reason=f"its process exited with code {code} before "
                    f"writing its verdict (see {LOG_NAME})")
    data["seconds"] = round(elapsed, 3)
    data["budget_s"] = budget
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def commit() -> str:
    found = os.environ.get("PIEP_GPU_CHECK_COMMIT")
    if found:
        return found
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def summary_table(results: Sequence[dict[str, Any]], dry_run: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="GPU check" + (" (DRY RUN: stand-ins, not a GPU)" if dry_run else ""))
    for column in ("section", "verdict", "seconds", "criteria passed", "what failed or why"):
        table.add_column(column)
    styles = {"passed": "green", "failed": "red", "error": "red", "timeout": "red",
              "skipped": "yellow"}
    for r in results:
        gated = [c for c in r.get("criteria", []) if c.get("passed") is not None]
        passed = sum(1 for c in gated if c["passed"])
        failed = [c["name"] for c in gated if not c["passed"]]
        why = "; ".join(failed) if failed else (r.get("reason") or "")
        status = r.get("status", "error")
        table.add_row(r["section"], f"[{styles.get(status, 'red')}]{status}[/]",
                      f"{r.get('seconds', 0):.1f}", f"{passed}/{len(gated)}", why)
    Console(width=140).print(table)


def run_all(out: Path, child: list[str], dry_run: bool, names: Sequence[str] | None = None,
            scale_budget: float = 1.0, budgets: dict[str, float] | None = None) -> int:
    """Every section (or `names`), in order; the summary; 1 when a section failed.
    `budgets`: seconds per section, instead of its budget times `scale_budget`."""
    out.mkdir(parents=True, exist_ok=True)
    selected = [BY_NAME[n] for n in names] if names else list(SECTIONS)
    started = datetime.now(UTC)
    t0 = time.monotonic()
    results = []
    with open(out / LOG_NAME, "a") as log:
        for i, section in enumerate(selected, 1):
            budget = (budgets or {}).get(section.name, section.budget_s * scale_budget)
            line = f"[{i}/{len(selected)}] {section.name}: {section.title} (budget {budget:.0f} s)"
            print(line, flush=True)
            log.write(line + "\n")
            data = run_child(section, out, child, log, budget)
            results.append(data)
            verdict = f"    {data['status']} in {data['seconds']:.1f} s" + (
                f": {data['reason']}" if data.get("reason") else "")
            print(verdict, flush=True)
            log.write(verdict + "\n")
    failing = [r["section"] for r in results if r.get("status") in FAILING]
    summary = {"dry_run": dry_run, "started": started.isoformat(), "commit": commit(),
               "seconds": round(time.monotonic() - t0, 3), "passed": not failing,
               "failing_sections": failing,
               "sections": [{k: r.get(k) for k in ("section", "title", "status", "reason",
                                                   "seconds", "budget_s")}
                            | {"failed_criteria": [c["name"] for c in r.get("criteria", [])
                                                   if c.get("passed") is False]}
                            for r in results]}
    (out / SUMMARY_NAME).write_text(json.dumps(summary, indent=1) + "\n")
    summary_table(results, dry_run)
    if failing:
        print(f"gpu check: FAILED: {', '.join(failing)} (details in {out})")
    else:
        print(f"gpu check: no section failed ({out})")
    return 1 if failing else 0
