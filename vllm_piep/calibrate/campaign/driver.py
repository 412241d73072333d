"""The campaign's loop: per config one attempt (a server start with the meter recording, an
idle window, then the cells not done), the state saved after every cell and every attempt's
outcome recorded, whether it completed, failed or was interrupted."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from vllm_piep.calibrate.campaign.load import _CellFailed, run_cell
from vllm_piep.calibrate.campaign.plan import CampaignError, CampaignPlan
from vllm_piep.calibrate.campaign.prompts import vocab_size
from vllm_piep.calibrate.campaign.recording import MeterRecording, measure_idle
from vllm_piep.calibrate.campaign.servers import server_options
from vllm_piep.calibrate.campaign.state import (
    STATE_FILE,
    AttemptRecord,
    CampaignState,
    Outcome,
    open_state,
)
from vllm_piep.meters.common import Meter, MeterError
from vllm_piep.predict.served import config_name
from vllm_piep.tools.server import ServerError, VllmServer


def build_meter(plan: CampaignPlan) -> tuple[Meter, str]:
    """The plan's meter, unstarted, and why it is the one (a setting as the serving option
    `meter` spells it)."""
    from vllm_piep.meters.auto import auto_meter, make_meter
    from vllm_piep.meters.factory import meter_factory
    from vllm_piep.meters.setting import parse_meter_setting

    setting = parse_meter_setting(plan.meter)
    if setting.kind != "name":  # external:PATH, module:callable: built as serving builds them
        return meter_factory(plan.meter)[0](), f"the plan asks for {setting.label!r}"
    # The CPU estimate samples /proc/stat on its own clock: as often as the log reads it.
    cpu_kw = {"period_s": plan.meter_interval_s}
    if setting.name == "auto":
        return auto_meter(cpu_kw=cpu_kw)
    meter = make_meter(setting.name,
                       **(cpu_kw if setting.name in ("cpu-estimate", "cpu") else {}))
    return meter, f"the plan asks for {plan.meter!r}"


def check_meter(plan: CampaignPlan) -> None:
    """Build the plan's meter and start and stop it once, as serving checks its `meter`, so
    that a meter that cannot run here is refused before the campaign writes anything."""
    try:
        meter, _ = build_meter(plan)
        meter.start()
        meter.stop()
    except Exception as exc:  # noqa: BLE001  (whatever stops it, a callable's own error too)
        what = str(exc) if isinstance(exc, MeterError) else f"{type(exc).__name__}: {exc}"
        raise CampaignError(f"--meter {plan.meter}: the meter cannot start here ({what}); "
                            "name one that runs on this machine (auto picks one)") from None


@dataclass
class _Campaign:
    plan: CampaignPlan
    out: Path
    state: CampaignState
    console: Console
    progress: Progress
    task: Any  # rich's TaskID
    vocab: int
    meter_announced: bool = False

    @property
    def state_path(self) -> Path:
        return self.out / STATE_FILE

    def save(self) -> None:
        self.state.save(self.state_path)

    def next_attempt(self, config: str) -> int:
        """One past every attempt in the state or on disk (a start may die before saving)."""
        numbers = [a.attempt for a in self.state.configs[config].attempts]
        numbers += [int(p.name.split("-", 1)[1])
                    for p in (self.out / "runs" / config).glob("attempt-*")
                    if p.name.split("-", 1)[1].isdigit()]
        return max(numbers, default=0) + 1

    def make_meter(self) -> Meter:
        meter, why = build_meter(self.plan)
        if not self.meter_announced:
            self.console.print(f"meter: [bold]{escape(meter.name)}[/] ({meter.source}): "
                               f"{escape(why)}")
            self.meter_announced = True
        return meter

    def run_config(self, tp: int, pp: int) -> None:
        """One attempt (a server start) for the cells of this config that are not done."""
        config = config_name(tp, pp)
        record = self.state.configs[config]
        pending = self.state.pending_cells(config, self.plan.cells())
        if pending:
            attempt, meter = self._begin_attempt(config)
            self._run_attempt(tp, pp, attempt, meter, pending)
        record.done = True
        self.save()

    def _begin_attempt(self, config: str) -> tuple[AttemptRecord, Meter]:
        meter = self.make_meter()
        number = self.next_attempt(config)
        rel = Path("runs") / config / f"attempt-{number}"
        (self.out / rel / "spans").mkdir(parents=True, exist_ok=True)
        attempt = AttemptRecord(attempt=number, dir=str(rel), meter=meter.name,
                                meter_source=meter.source)
        self.state.configs[config].attempts.append(attempt)
        self.save()  # the directory is taken, even if this attempt dies before its first cell
        self.console.print(f"{config}: starting vLLM (attempt {number})...")
        return attempt, meter

    def _run_attempt(self, tp: int, pp: int, attempt: AttemptRecord, meter: Meter,
                     pending: list[str]) -> None:
        config, attempt_dir = config_name(tp, pp), self.out / attempt.dir
        server = VllmServer(server_options(self.plan, tp, pp, attempt_dir / "spans"),
                            log_path=attempt_dir / "server.log")
        # Started before the server and stopped after it: the log covers the whole attempt.
        recording = MeterRecording(meter, attempt_dir / "meter.jsonl",
                                   self.plan.meter_interval_s,
                                   {"config": config, "attempt": attempt.attempt})
        failure: Exception | None = None  # vLLM failed: reported once the server is stopped
        log_tail = ""
        try:
            recording.start()
            try:
                self._serve(server, attempt, config, pending, recording)
            except (_CellFailed, ServerError) as exc:
                failure = exc
                log_tail = server.log_tail()  # now: the shutdown adds only noise
            finally:
                try:
                    server.stop()  # its process group, then the shm files it left
                finally:
                    recording.stop()
        except BaseException as exc:  # Ctrl-C, SIGTERM, a meter error: the state says so
            interrupted = isinstance(exc, KeyboardInterrupt | SystemExit)
            self._end_attempt(attempt, "interrupted" if interrupted else "failed",
                              f"{type(exc).__name__}: {exc}")
            raise
        if failure is not None:
            self._end_attempt(attempt, "failed", str(failure))
            raise self._failure(config, attempt.attempt, failure, server.log_path,
                                log_tail) from failure
        self._end_attempt(attempt, "completed", None)

    def _end_attempt(self, attempt: AttemptRecord, outcome: Outcome, error: str | None) -> None:
        attempt.outcome = outcome
        attempt.error = error if error is None or len(error) < 4000 else "..." + error[-4000:]
        self.save()

    def _failure(self, config: str, attempt: int, failure: Exception, log_path: Path,
                 log_tail: str) -> CampaignError:
        if isinstance(failure, _CellFailed):
            what = f"{failure}\nlast lines of {log_path} when it failed:\n{log_tail}"
        else:  # a failed start: the ServerError carries the log's tail already
            what = f"vLLM did not start: {failure}"
        return CampaignError(f"{config}, attempt {attempt}, {what}\nThe finished cells are "
                             f"saved in {self.state_path}; rerun with --resume to go on.")

    def _serve(self, server: VllmServer, attempt: AttemptRecord, config: str,
               pending: list[str], recording: MeterRecording) -> None:
        started = time.monotonic()
        server.start()
        attempt.server_pid = server.pid
        attempt.idle = measure_idle(self.plan.idle_s, self.out / attempt.dir / "idle.json")
        self.save()
        self.console.print(f"{config}: ready in {time.monotonic() - started:.0f} s; idle "
                           f"baseline {attempt.idle.seconds:.1f} s; {len(pending)} cells")
        workloads = dict(zip(self.plan.cells(), self.plan.workloads(), strict=True))
        for cell in pending:
            batch, out_len = workloads[cell]
            self.progress.update(self.task, description=f"{config} {cell}")
            result = run_cell(server, self.plan, cell, batch, out_len, attempt.attempt,
                              self.vocab)
            recording.check()  # a cell without meter readings is not done
            self.state.configs[config].cells[cell] = result
            self.save()  # the cell is done from here on
            self.progress.advance(self.task)


def run_campaign(plan: CampaignPlan, out: Path, resume: bool = False,
                 console: Console | None = None) -> CampaignState:
    """Profile every cell of every config of `plan` into `out` (see the package docstring).
    Raises CampaignError when vLLM fails (the state keeps every finished cell for `resume`),
    and before writing anything when the meter cannot start here."""
    out = Path(out)
    console = console or Console()
    state = open_state(plan, out, resume)
    vocab = vocab_size(plan.model)
    check_meter(plan)
    out.mkdir(parents=True, exist_ok=True)
    state.save(out / STATE_FILE)
    cells = plan.cells()
    total = len(cells) * len(plan.configs())
    done = sum(len(r.cells) for r in state.configs.values())
    if done:
        console.print(f"resuming {out / STATE_FILE}: {done} of {total} cells done")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("cells", total=total, completed=done)
        campaign = _Campaign(plan, out, state, console, progress, task, vocab)
        for tp, pp in plan.layouts():
            try:
                campaign.run_config(tp, pp)
            except MeterError as exc:
                raise CampaignError(f"{config_name(tp, pp)}: {exc}. The finished cells are "
                                    f"saved in {out / STATE_FILE}; rerun with --resume to go "
                                    f"on.") from exc
    state.finished = all(r.done for r in state.configs.values())
    state.save(out / STATE_FILE)
    console.print(f"campaign {'finished' if state.finished else 'not finished'}: "
                  f"{out / STATE_FILE}")
    return state
