"""The engine loop's accounting calls, queued in order and run off the loop.

The engine core's busy loop is vLLM's serving bottleneck: with async scheduling its Python time
hides under the GPU step only while it is shorter. So on its critical path (a step's output to
the next step's dispatch) the loop only keeps what a step is made of and queues the accountant's
calls (`queue`: one deque append, without a Python frame). The calls run later, in the order
they were queued, under the accountant's lock (`run`): on the loop once it has dispatched the
next step (the device is busy; no other thread contends for the GIL), on vLLM's output thread
when a batch it must send still waits for them (`wait_run` first leaves the loop the GIL), on
the meter thread before it settles, and inside the step itself when nothing else would run them
(an in-process engine without an output thread) or the queue grows past `MAX_QUEUED`.

Running the same calls in the same order gives the same state: only when it is computed moves.

No vLLM imports.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from vllm_piep.once import OnceLogger

# Steps without outputs (a long prompt's chunked prefill) queue calls without a batch that
# would run them: past this many, the loop runs them itself.
MAX_QUEUED = 4096


class DeferredCalls:
    """Calls queued by the engine loop, run in order by whoever needs their result."""

    # The loop reads `queue`, `calls` and `off_loop` on its critical path: a slot is one load.
    __slots__ = ("calls", "queue", "off_loop", "_on_error", "_once", "ran", "_ran_cond")

    def __init__(self, on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self.calls: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        # The engine loop's way to queue a `(call, args)` pair: the deque's own append, one C
        # call (a method of this class would add a Python frame on the critical path). The loop
        # then runs the calls itself if `not off_loop` (and, once per step, if
        # `len(calls) > MAX_QUEUED`).
        self.queue = self.calls.append
        # Set once vLLM's output thread makes sure of the calls before every batch it sends:
        # from then on the loop runs them after dispatching a step, not inside it.
        self.off_loop = False
        self._on_error = on_error
        self._once = OnceLogger()
        self.ran = 0  # calls run so far
        self._ran_cond = threading.Condition(threading.Lock())

    def add(self, call: Callable[..., Any], *args: Any) -> bool:
        """Queue a call (the engine loop's thread); whether the loop must run the queued calls
        itself now (`due_on_loop`)."""
        self.queue((call, args))
        return self.due_on_loop()

    def wait_run(self, timeout_s: float) -> bool:
        """Wait, without the GIL, until every call queued so far has run (by another thread);
        False after `timeout_s`. (A run in progress has taken calls off the queue before it
        counts them: the target can fall short by those, which the caller's run then waits for
        under the lock.)"""
        target = self.ran + len(self.calls)
        if self.ran >= target:
            return True
        with self._ran_cond:
            return self._ran_cond.wait_for(lambda: self.ran >= target, timeout_s)

    def __len__(self) -> int:
        return len(self.calls)

    def due_on_loop(self) -> bool:
        """Whether the loop must run the queued calls itself now."""
        return not self.off_loop or len(self.calls) > MAX_QUEUED

    def run(self) -> int:
        """Run every queued call, oldest first; a call that raises is counted and logged once,
        and the rest still run. The caller holds the accountant's lock. Returns how many ran."""
        calls = self.calls
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
        if ran:
            with self._ran_cond:
                self.ran += ran
                self._ran_cond.notify_all()
        return ran
