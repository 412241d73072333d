"""Engine core: requests the engine released (finished with their final output, or aborted from
outside) while a step already scheduled may still name them (`ReleaseBook`): a late step's share
of one goes to no output (unsent or after-finish energy) and must not track it again. Also the
releases vLLM's own update makes (errors), which wait until that update's outputs carried their
rows, and when the engine last swept for requests the scheduler dropped. No vLLM imports."""

from __future__ import annotations

from typing import NamedTuple

MAX_PENDING_STEPS = 64  # scheduled but not yet updated steps (async scheduling, PP batch queue)


class Gone(NamedTuple):
    """A request the engine released while a step already scheduled may still name it."""

    step: int  # the engine's step count at the release
    aborted: bool  # False: it finished and its final output went out
    prompt: float  # its prompt length, for the share of a step that still names it


class ReleaseBook:
    """Released requests a step in flight may name, and the last sweep."""

    def __init__(self) -> None:
        self.gone: dict[str, Gone] = {}
        self.last_sweep = 0  # steps done at the last sweep

    def remember(self, req_id: str, aborted: bool, prompt: float | None, steps: int) -> None:
        """A released request a step in flight may still name (its prompt: None where it had no
        slot, then the one remembered before stays)."""
        gone = self.gone.pop(req_id, None)  # again: it moves to the end (the newest)
        if prompt is None or (gone is not None and not prompt):
            prompt = gone.prompt if gone is not None else 0.0
        self.gone[req_id] = Gone(steps, aborted, prompt)

    def late(self, req_ids: list[str]) -> list[tuple[str, bool]]:
        """Those of a step's requests that were released before it was done, and whether each
        was aborted."""
        gone = self.gone
        return [(r, gone[r].aborted) for r in gone.keys() & set(req_ids)]

    def prompt_of(self, req_id: str) -> float | None:
        gone = self.gone.get(req_id) if self.gone else None
        return None if gone is None else gone.prompt

    def expire(self, steps: int) -> None:
        """Released requests no step still in flight can name: forgotten (oldest first: the
        book keeps them in the order they were released)."""
        gone = self.gone
        if gone:
            oldest = steps - MAX_PENDING_STEPS
            for req_id in gone:
                if gone[req_id].step >= oldest:
                    return
                break
            for req_id in [r for r, g in gone.items() if g.step < oldest]:
                del gone[req_id]

    def sweep_due(self, steps_done: int, every: int) -> bool:
        """Whether `every` steps passed since the last sweep (then this one counts)."""
        if steps_done - self.last_sweep < every:
            return False
        self.last_sweep = steps_done
        return True
