"""Engine core, sparse mode: an output that finishes a request while steps wait in the log is
held (`HeldOutputs.hold`) and goes out once a pass has evaluated the steps before it, with the
total they gave it (`take_ready`): after `HOLD_S` at most while the engine is busy, at once when
it goes idle. Measured mode holds finished outputs until the meter speaks for their steps
(`measured.py`), with the same bound on the pass (`note_hold`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from vllm_piep.runtime.engine_core.log_pass import HOLD_ENTRY
from vllm_piep.runtime.engine_core.request_table import SENT, ZERO_SLOT
from vllm_piep.runtime.record import COLUMN, ROW_FIELDS

_PREFILL, _DECODE = COLUMN["prefill"], COLUMN["decode"]
# How long a finished request's output waits for the log's pass while the engine is busy.
HOLD_S = 0.05


class Ready(NamedTuple):
    """A held output a pass released: its client, the output, and the row it carries."""

    client: int
    output: Any
    row: np.ndarray


class HeldOutputs:
    """Held finishing outputs (module docstring). A part of `EngineAccountant`
    (`accountant.py`), which sets up the state it uses."""

    ready: list[Ready]
    holding: set[str]
    _oldest_hold_ns: int | None

    def holds_outputs(self) -> bool:
        """Whether a finishing output waits for the log's next pass (module docstring)."""
        return (self.sparse and self.splitter is None and self.put_outputs is not None
                and self._log_steps > 0)

    def hold(self, client: int, output: Any) -> None:
        """A finishing output waits in the log: the pass that evaluates the steps before it
        releases it with its total (`take_ready`)."""
        self._log.append((HOLD_ENTRY, client, output))
        self.holding.add(output.request_id)
        self.note_hold()

    def note_hold(self) -> None:
        """An output is held for the log's steps (here, or for the meter, `measured.py`):
        the pass is due `HOLD_S` from the first such."""
        if self._oldest_hold_ns is None and self._log_steps:
            self._oldest_hold_ns = self.now_ns()

    def pass_due(self) -> bool:
        """Whether a held output has waited `HOLD_S` for the log's pass."""
        oldest = self._oldest_hold_ns
        return oldest is not None and (self.now_ns() - oldest) / 1e9 >= HOLD_S

    def _ready(self, client: int, output: Any) -> None:
        """A held output's turn in the pass: its total as of the steps before it (marked sent,
        as `encode` does), then its release, as when it would have gone out at once."""
        req_id = output.request_id
        table = self.table
        slot = table.slots.get(req_id, ZERO_SLOT)
        row = table.rows[slot, :len(ROW_FIELDS)].copy()
        if slot != ZERO_SLOT:
            table.rows[slot, SENT] = row[_PREFILL] + row[_DECODE]
        self.holding.discard(req_id)
        self._release_now(req_id, aborted=False)
        self.ready.append(Ready(client, output, row))

    def take_ready(self) -> list[Ready]:
        ready, self.ready = self.ready, []
        return ready
