"""A cell's load: `batch` concurrent completion requests sent to the server at once, timed
on CLOCK_MONOTONIC and checked, while watching that the server process lives."""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from vllm_piep.calibrate.campaign.plan import CampaignPlan
from vllm_piep.calibrate.campaign.prompts import prompt_ids
from vllm_piep.calibrate.campaign.servers import REQUEST_TIMEOUT_S
from vllm_piep.calibrate.campaign.state import CellRecord
from vllm_piep.clock import now_ns  # CLOCK_MONOTONIC: the clock of span files and meter logs
from vllm_piep.tools.server import VllmServer

# How often a cell's requests are checked on, and the server process with them (see
# servers.REQUEST_TIMEOUT_S).
WATCH_INTERVAL_S = 0.5


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
