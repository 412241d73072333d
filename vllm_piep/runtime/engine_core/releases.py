"""Engine core: requests released (finished with their final output, or aborted from outside),
their rows freed and what no output carried counted (unsent, aborted, after-finish), so that
the engine's totals add up. A request released while a step already scheduled names it is
remembered (`Gone`) until no step in flight can."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from vllm_piep.runtime.engine_core.decode_runs import DecodeRuns
from vllm_piep.runtime.engine_core.request_table import SENT, RequestTable
from vllm_piep.runtime.record import COLUMN

_PREFILL, _DECODE = COLUMN["prefill"], COLUMN["decode"]
MAX_PENDING_STEPS = 64  # scheduled but not yet updated steps (async scheduling, PP batch queue)
_MAX_RELEASED = 4096  # released requests remembered for their steps still to be settled


class Gone(NamedTuple):
    """A request the engine released while a step already scheduled may still name it."""

    step: int  # the engine's step count at the release
    aborted: bool  # False: it finished and its final output went out
    prompt: float  # its prompt length, for the share of a step that still names it


class Releases:
    """Releasing requests (module docstring). A part of `EngineAccountant`
    (`accountant.py`), which sets up the state it uses."""

    table: RequestTable
    runs: DecodeRuns | None
    _gone: dict[str, Gone]

    def release(self, req_id: str, aborted: bool = True, final: bool = False) -> None:
        """The engine is done with the request (`aborted`: from outside, with no final
        output, possibly while a step of it runs; else it finished with this output). Energy
        no output carried is counted as unsent (aborted) or after-finish (finished), so the
        engine's totals still add up. `final`: a gone request's late step was accounted."""
        if aborted and self._deferred_releases is not None and not final:
            self._deferred_releases.append(req_id)  # its output of this update still goes out
            return
        self._release_now(req_id, aborted, final)

    def _release_now(self, req_id: str, aborted: bool = True, final: bool = False) -> None:
        # Sparse mode: no output carried any of a request aborted from outside unless every
        # output carried its row; what it cost is the client's abort, not an unsent remainder.
        no_output = self.sparse and not final and req_id not in self.dense_ids
        self.dense_ids.discard(req_id)
        if self.runs is not None:
            self.runs.leave(req_id)
        table = self.table
        slot = table.slots.pop(req_id, None)
        prompt = 0.0
        if slot is not None:
            row = table.rows[slot]
            left = float(row[_PREFILL] + row[_DECODE] - row[SENT])
            if left < 0.0:
                # Warm-up energy taken back after an output had carried it: the API server
                # counts the request by that output, so it is not warm-up after all.
                self.warmup_joules += left
            elif aborted and no_output:
                self.aborted_joules += left
            elif aborted:
                self.unsent_joules += left
            else:
                self.after_finish_joules += left
            prompt = float(table.prompt[slot])
            table.reset(slot)
            table.free.append(slot)
        if self.splitter is not None:  # its steps waiting for the meter: unsent or not
            self._released[req_id] = aborted
            self._released.move_to_end(req_id)
            if len(self._released) > _MAX_RELEASED:
                self._released.popitem(last=False)
        if aborted or self._pending:  # a step already scheduled may still name it
            gone = self._gone.get(req_id)
            self._gone[req_id] = Gone(self.steps, aborted,
                                      prompt if gone is None or prompt else gone.prompt)

    def defer_releases(self) -> None:
        """vLLM may finish requests inside `update_from_output` (errors): their outputs of
        this step still carry their totals, so their release waits for `release_deferred`."""
        self._deferred_releases = []

    def release_deferred(self) -> None:
        deferred, self._deferred_releases = self._deferred_releases, None
        for req_id in deferred or ():
            self.release(req_id)

    def sweep(self, live: Iterable[str], every: int = 1) -> None:
        """Release requests the engine no longer has (aborted without a final output); at most
        once per `every` steps."""
        if self.steps_done - self._last_sweep < every:
            return
        self._last_sweep = self.steps_done
        live_set = set(live) | self.waiting
        for req_id in [r for r in self.table.slots if r not in live_set]:
            self.release(req_id)

    def _forget_gone(self, req_ids: list[str]) -> None:
        """Requests released while a step of theirs ran: no output will carry this step's
        share. An aborted request's share is unsent energy; a finished one's (async
        scheduling had already put it into this step) is after-finish energy. Neither may stay
        tracked."""
        for req_id in self._gone.keys() & set(req_ids):
            self._release_now(req_id, aborted=self._gone[req_id].aborted, final=True)

    def _expire_gone(self) -> None:
        """Released requests no step still in flight can name: forgotten."""
        oldest = self.steps - MAX_PENDING_STEPS
        if self._gone:
            for req_id in [r for r, gone in self._gone.items() if gone.step < oldest]:
                del self._gone[req_id]
