"""Offline inference (`vllm.LLM`): every finished `RequestOutput` carries its energy as `energy`.

`LLM.generate`, `LLM.chat` (and the other `LLM` methods) drive `LLMEngine.step`, whose
`OutputProcessor` runs in the user's process: `outputs.py` takes the records off the engine's
outputs into the ledger and closes each request there when vLLM finishes it, as in the API
server, remembering its owner by the request id its output carries (`response_ids.py`).
`LLMEngine.step` is wrapped to hand each finished output the record a served response would
carry in `usage.energy`: the same `UsageEnergy` from the same ledger entries (its n > 1
samples' together), taken out of the ledger at once so that nothing stays behind.

`RequestOutput` has no field for it: `metrics` is vLLM's own timing statistics (a
`RequestStateStats`, None unless stats are logged), so the record is a plain attribute
(`ENERGY_ATTR`), set on finished outputs only; None when a step of the request went
unaccounted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_piep.once import OnceLogger
from vllm_piep.runtime.api_server.ledger import UsageEnergy, usage_energy
from vllm_piep.runtime.api_server.outputs import ledger
from vllm_piep.runtime.api_server.response_ids import finished_owner, remember_finished_owners
from vllm_piep.runtime.patching import Patch

ENERGY_ATTR = "energy"  # on a finished RequestOutput: its UsageEnergy, or None

_once = OnceLogger()


def completion_tokens(output: Any) -> int:
    """Tokens generated for this output, over all its samples (a served response's
    `usage.completion_tokens`); 0 for outputs without completions (pooling)."""
    completions = getattr(output, "outputs", None)
    if not isinstance(completions, list):
        return 0
    return sum(len(getattr(c, "token_ids", None) or ()) for c in completions)


def energy_of(output: Any) -> UsageEnergy | None:
    """The energy of a finished output, its records taken out of the ledger (found by its
    request id, which `LLM` makes unique)."""
    owner = finished_owner(output.request_id)
    if owner is None:
        return None
    book = ledger()
    return usage_energy(book.take([owner]), completion_tokens(output), book.intensity())


def _wrap_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        remember_finished_owners()
        request_outputs = original(self, *args, **kwargs)
        try:
            for output in request_outputs or ():
                if getattr(output, "finished", False):
                    setattr(output, ENERGY_ATTR, energy_of(output))
        except Exception as exc:  # boundary
            _once.warn("adding energy to offline outputs", exc, "some outputs carry none")
        return request_outputs

    return step


def patches() -> list[Patch]:
    from vllm.v1.engine.llm_engine import LLMEngine

    return [
        Patch(LLMEngine, "step", _wrap_step,
              why="gives each finished RequestOutput of offline inference (vllm.LLM) the "
                  "energy record a served response carries in usage.energy",
              how="after the original: takes each finished output's records (all its "
                  "samples') from the ledger and sets `energy` (a UsageEnergy, or None) on it",
              until="RequestOutput carries a field for plugins"),
    ]
