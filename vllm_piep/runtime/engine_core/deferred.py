"""The engine loop's accounting calls, queued in order and run off the loop.

The engine core's busy loop is vLLM's serving bottleneck: with async scheduling its Python time
hides under the GPU step only while it is shorter. So the loop only copies what a step is made
of and queues the accountant's calls (`add`: one deque append, a few hundred nanoseconds); the
calls run later, in the order they were queued, under the accountant's lock (`run`): on vLLM's
output thread just before it serializes a batch of outputs (whose records those calls attach),
on the meter thread before it settles, and on the loop itself while nothing runs them elsewhere
(an in-process engine without an output thread) or when the queue grows past `MAX_QUEUED`.

Running the same calls in the same order gives the same state: only when it is computed moves.
No vLLM imports.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from vllm_piep.once import OnceLogger

# Steps without outputs (a long prompt's chunked prefill) queue calls without a batch that
# would run them: past this many, the loop runs them itself.
MAX_QUEUED = 4096


class DeferredCalls:
    """Calls queued by the engine loop, run in order by whoever needs their result."""

    def __init__(self, on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        # Set once another thread (vLLM's output thread) runs the calls before every batch it
        # sends: from then on the loop leaves them to it.
        self.off_loop = False
        self._on_error = on_error
        self._once = OnceLogger()

    def add(self, call: Callable[..., Any], *args: Any) -> None:
        """Queue a call (any thread; `deque.append` is atomic)."""
        self._calls.append((call, args))

    def __len__(self) -> int:
        return len(self._calls)

    def due_on_loop(self) -> bool:
        """Whether the loop must run the queued calls itself now."""
        return not self.off_loop or len(self._calls) > MAX_QUEUED

    def run(self) -> int:
        """Run every queued call, oldest first; a call that raises is counted and logged once,
        and the rest still run. The caller holds the accountant's lock. Returns how many ran."""
        calls = self._calls
        ran = 0
        while calls:
            try:
                call, args = calls.popleft()
            except IndexError:  # another thread ran the last one: cannot happen under the lock
                break
            ran += 1
            try:
                call(*args)
            except Exception as exc:  # boundary: one bad step must not stop the others
                name = getattr(call, "__name__", repr(call))
                if self._on_error is not None:
                    self._on_error(name, exc)
                else:
                    self._once.warn(f"accounting ({name})", exc,
                                    "energy of the affected requests may be missing")
        return ran
