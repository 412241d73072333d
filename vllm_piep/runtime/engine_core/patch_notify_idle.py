"""Engine core: `EngineCoreProc._notify_idle_state_callbacks` wrapped to flush an idle engine
(`flush_idle`): the requests the scheduler no longer has released, and the counts not yet sent
out on an output no request owns, so that /metrics is complete without waiting for the next
request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_piep.once import OnceLogger
from vllm_piep.runtime.engine_core.scheduler_accountant import ACCOUNTANT_ATTR, accountant
from vllm_piep.runtime.patching import Patch
from vllm_piep.runtime.record import HEADER_KEY, ROWS_KEY

_once = OnceLogger()


FLUSH_REQUEST_ID = "piep-idle-flush"  # no request has it: vLLM's API server skips the output


def flush_idle(engine: Any) -> None:
    """An idle engine: its counts not yet sent (the last steps' energy, aborts while idle, the
    tracked requests back to zero) out on an output of their own, which no request owns:
    without it they would wait for the next request."""
    scheduler = getattr(engine, "scheduler", None)
    queue = getattr(engine, "output_queue", None)  # an in-process engine (LLM) has none
    if scheduler is None or queue is None:
        return
    acc = scheduler.__dict__.get(ACCOUNTANT_ATTR)
    if acc is None:
        if not hasattr(scheduler, "vllm_config"):
            return
        acc = accountant(scheduler)  # idle at start: meet it now
    with acc.lock:
        # Idle: every request the scheduler no longer has is released now (an abort that
        # raced a step leaves one behind), not at the next request's periodic sweep.
        acc.deferred.run()
        acc.sweep(getattr(scheduler, "requests", None) or (), every=0)
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    with acc.lock:
        if not acc.unreported():
            return
        params = {HEADER_KEY: acc.header(counts=True).encode(), ROWS_KEY: b""}
    output = EngineCoreOutput(request_id=FLUSH_REQUEST_ID, new_token_ids=[],
                              kv_transfer_params=params)
    queue.put_nowait((acc.reports.client, EngineCoreOutputs(outputs=[output])))


def _wrap_notify_idle(original: Callable[..., Any]) -> Callable[..., Any]:
    def _notify_idle_state_callbacks(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            flush_idle(self)
        except Exception as exc:  # boundary
            _once.warn("sending an idle engine's energy", exc,
                       "/metrics shows it with the next request")
        return result

    return _notify_idle_state_callbacks


def patch() -> Patch:
    from vllm.v1.engine.core import EngineCoreProc

    return Patch(EngineCoreProc, "_notify_idle_state_callbacks", _wrap_notify_idle,
          why="an idle engine's last counts reach /metrics without waiting for the next "
              "request",
          how="after the original (called while the engine has no work), puts the counts "
              "not yet sent on an output no request owns, in the engine's output queue",
          until="vLLM's engine core exports plugin metrics, or has an idle hook")
