"""The vLLM server of an attempt: its options (detail mode, the parallel layout, one disjoint
set of cores per CPU rank), and the stale servers of killed drivers, stopped."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vllm_piep.calibrate.campaign.plan import CampaignError, CampaignPlan, runs_on_cpu
from vllm_piep.tools.server import ServerOptions

# A cell's requests are waited for this long at most; a live server answers long before (a dead
# one is noticed within WATCH_INTERVAL_S by the process check).
REQUEST_TIMEOUT_S = 3600.0


def stop_stale_server(pgid: int) -> None:
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
    bind = omp_bind(tp * pp) if runs_on_cpu() else None
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    assert plan.max_model_len is not None  # filled in by the plan's validator
    return ServerOptions(model=plan.model, max_model_len=plan.max_model_len, dtype=plan.dtype,
                         enforce_eager=True, extra_args=args, extra_env=env)
