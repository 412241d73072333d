"""Engine core: `EngineCoreProc.run_busy_loop` (and the data-parallel engine's own) wrapped to set
the engine's accountant up when the built engine starts serving (`start_accounting`): it sends
outputs of its own on the engine's output queue, and measured mode starts there when a meter
serves (`measured_start.py`). The engine's constructor is too early: vLLM loads the plugin
inside it. An in-process engine (`LLM`: `EngineCore`, no busy loop) stays in prediction
mode."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from vllm_piep.once import OnceLogger
from vllm_piep.runtime.engine_core.measured_start import start_engine_meter
from vllm_piep.runtime.engine_core.output_records import put_outputs
from vllm_piep.runtime.engine_core.patch_notify_idle import flush_idle
from vllm_piep.runtime.engine_core.scheduler_accountant import accountant
from vllm_piep.runtime.patching import Patch

_once = OnceLogger()


def start_accounting(engine: Any) -> None:
    """A built engine's accountant: its output queue, and measured mode where a meter serves."""
    scheduler = getattr(engine, "scheduler", None)
    queue = getattr(engine, "output_queue", None)
    if scheduler is None or queue is None or not hasattr(scheduler, "vllm_config"):
        return
    acc = accountant(scheduler)
    if acc.put_outputs is not None:  # started already (a subclass's loop calls its parent's)
        return
    acc.put_outputs = partial(put_outputs, queue)
    try:
        start_engine_meter(engine, acc, partial(flush_idle, engine))
    except Exception as exc:  # boundary: no measured mode, never a failed start
        _once.warn("starting measured mode", exc, "responses carry the model's prediction")


def _wrap_run_busy_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    def run_busy_loop(self: Any) -> Any:
        try:
            start_accounting(self)
        except Exception as exc:  # boundary: the engine serves without measured mode
            _once.warn("setting up the engine's energy accounting", exc,
                       "responses carry the model's prediction")
        return original(self)

    return run_busy_loop


_WHY = ("sets the engine's accountant up when the built engine starts serving: its output "
        "queue for outputs that wait for the meter, and measured mode's meter thread")
_HOW = ("before the original (the engine, its scheduler, its output queue and its "
        "data-parallel rank are set by then), starts the meter thread when a meter serves")
_UNTIL = "vLLM offers an engine-started hook for plugins"


def patches() -> list[Patch]:
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc

    return [Patch(EngineCoreProc, "run_busy_loop", _wrap_run_busy_loop, why=_WHY, how=_HOW,
                  until=_UNTIL, signature="(self)"),
            Patch(DPEngineCoreProc, "run_busy_loop", _wrap_run_busy_loop,
                  why=_WHY + " (a data-parallel engine's loop of its own)", how=_HOW,
                  until=_UNTIL, signature="(self)")]
