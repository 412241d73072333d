"""Per-process recording of step, module and collective spans (the worker side of detail mode).
No vLLM imports: `detail.py` and `step.py` call into it.

The step loop only takes timestamps and appends tuples; each finished step is handed to the
`SpanWriter` as a closure that builds its records on the writer's thread. On a GPU the marks are
CUDA events, resolved there too (one `synchronize` per step on the writer thread, none on the
step loop); on a CPU they are `perf_counter_ns` values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_piep.clock import now_ns
from vllm_piep.model.tree import ModelTree, TreeNode
from vllm_piep.runtime.worker.replay import ReplaySampler, ReplayWindows
from vllm_piep.spans.records import module_range_name, step_range_name
from vllm_piep.spans.writer import SpanWriter

_profiler_on = torch.autograd._profiler_enabled
_Range = torch.autograd.profiler.record_function


def _open_range(name: str) -> Any:
    """A torch.profiler range (for kernels_trace), only while a profiler runs: costs nothing
    otherwise."""
    if not _profiler_on():
        return None
    rf = _Range(name)
    rf.__enter__()
    return rf


class HostTimer:
    """Host clock marks: right for CPU execution, where work is done when the call returns."""

    name = "perf_counter_ns"

    def mark(self) -> Any:
        return now_ns()

    def resolver(self, anchor_ns: int, anchor: Any) -> Callable[[Any], int]:
        return lambda mark: mark

    def step_done(self, end: Any, end_ns: int) -> None:
        pass


class CudaEventTimer:
    """CUDA events on the current stream. A step's events are timed against the step's first
    event. That event runs when it is recorded if the GPU is idle then, or when the previous
    step's work ends if it is not (async scheduling launches a step before the previous one
    finishes): its host time is the later of its recording and the previous step's resolved
    end plus the GPU time between the two events. Steps are resolved in order on the span
    writer's thread, which keeps the previous end (`step_done`)."""

    name = "cuda_event"

    def __init__(self, event_factory: Callable[[], Any] | None = None):
        if event_factory is None:
            import torch

            event_factory = lambda: torch.cuda.Event(enable_timing=True)
        self._event = event_factory
        self._previous_end: tuple[Any, int] | None = None  # (event, host ns)

    def mark(self) -> Any:
        event = self._event()
        event.record()
        return event

    def resolver(self, anchor_ns: int, anchor: Any) -> Callable[[Any], int]:
        anchor.synchronize()
        if self._previous_end is not None:
            event, end_ns = self._previous_end
            queued = end_ns + int(round(event.elapsed_time(anchor) * 1e6))
            anchor_ns = max(anchor_ns, queued)

        def resolve(mark: Any) -> int:
            mark.synchronize()
            return anchor_ns + int(round(anchor.elapsed_time(mark) * 1e6))  # ms -> ns

        return resolve

    def step_done(self, end: Any, end_ns: int) -> None:
        self._previous_end = (end, end_ns)


@dataclass
class _Step:
    index: int
    start: Any
    start_ns: int
    end: Any = None
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_reqs: int = 0
    context_tokens: int = 0
    attended_pairs: int = 0
    sampled_rows: int = 0
    batch: Any = None  # what `counter` turns into the counts above, on the writer's thread
    modules: list[tuple[int, Any, Any]] = field(default_factory=list)
    collectives: list[tuple[Any, ...]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)  # repeated-sampling windows
    replay_ns: int = 0
    step_time: Any = None  # the step time the engine is sent (`steptime.StepTime`)


class StepRecorder:
    """Collects one rank's spans step by step and hands finished steps to a writer.

    `detail` False records step spans only (what the serve path always has); True adds module
    spans (through `enter`/`exit`, called by forward hooks on the tree's modules) and collective
    spans (`collective`, called by the group-coordinator wrappers).
    """

    def __init__(self, writer: SpanWriter | None, tree: ModelTree | None = None,
                 timer: HostTimer | CudaEventTimer | None = None,
                 counter: Callable[[Any], tuple[int, int, int, int, int, int]] | None = None):
        self.writer = writer
        self.tree = tree
        self.detail = tree is not None
        self.timer = timer or HostTimer()
        self.counter = counter
        self.resources: Any = None  # a running ResourceSampler writing into the same file
        self.nodes: list[TreeNode] = tree.module_nodes() if tree is not None else []
        self.node_index = {n.id: i for i, n in enumerate(self.nodes)}
        self._step: _Step | None = None
        self._next_index = 0
        self._stack: list[tuple[int, Any, Any]] = []  # (node, start mark, profiler range)
        self._range_names = [module_range_name(n.type, n.id) for n in self.nodes]
        self._step_range: Any = None
        self._seq: dict[tuple[str, int, int], int] = {}
        self._local = threading.local()
        self.anomalies = 0  # hook calls that did not nest (counted, never raised)
        self.sampler: ReplaySampler | None = None  # repeated sampling (detail mode, campaign)

    # --------------------------------------------------------------- steps
    @property
    def step_open(self) -> bool:
        return self._step is not None

    def begin_step(self, sample_key: Hashable | None = None) -> None:
        """`sample_key`: the step's shape, by which the sampler decides to sample it."""
        if self._step is not None:
            self.end_step()
        if self.sampler is not None:
            self.sampler.begin_step(sample_key)
        self._step_range = _open_range(step_range_name(self._next_index))
        start = self.timer.mark()
        self._step = _Step(self._next_index, start, now_ns())
        self._next_index += 1
        self._stack.clear()

    def set_counts(self, prefill: int, decode: int, num_reqs: int, context: int = 0,
                   pairs: int = 0, sampled: int = 0) -> None:
        step = self._step
        if step is not None:
            step.prefill_tokens, step.decode_tokens, step.num_reqs = prefill, decode, num_reqs
            step.context_tokens, step.attended_pairs, step.sampled_rows = context, pairs, sampled

    def set_batch(self, batch: Any) -> None:
        """What the step computed, to be counted by `counter` off the step loop."""
        if self._step is not None:
            self._step.batch = batch

    def set_step_time(self, step_time: Any) -> None:
        """The step's time as the engine is sent it (`steptime.StepTime`), read off the step
        loop when the step's records are built."""
        if self._step is not None:
            self._step.step_time = step_time

    def mark_end(self) -> None:
        """The step's work has ended so far (it may go on in a later call of the same step)."""
        if self._step is not None:
            self._step.end = self.timer.mark()

    def end_step(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        if step.end is None:
            step.end = self.timer.mark()
        for _, _, rf in reversed(self._stack):  # ranges left open by an exception
            if rf is not None:
                rf.__exit__(None, None, None)
        self._stack.clear()
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self.writer is not None:
            self.writer.put(self._records_of(step))

    # --------------------------------------------------------------- modules
    @property
    def replaying(self) -> bool:
        return self.sampler is not None and self.sampler.replaying

    def sampling(self, node: int | None) -> ReplaySampler | None:
        """The sampler when the current step is sampled, no replay is running and the step
        replays `node` (a layer's node only on the step's share of the layers)."""
        sampler = self.sampler
        if sampler is None or not sampler.active or sampler.replaying or self._step is None:
            return None
        if node is not None and not sampler.covers(self.nodes[node].layer):
            return None
        return sampler

    def add_replay(self, windows: ReplayWindows, node: int | None, target: str,
                   op: str | None = None, group: str | None = None,
                   seq: int | None = None) -> None:
        step = self._step
        if step is None:
            return
        step.replay_ns += windows.spent_ns
        name = self.nodes[node].id if node is not None else None
        for i, (start, end) in enumerate(windows.windows):
            step.samples.append({"kind": "sample", "step": step.index, "target": target,
                                 "node": name, "op": op, "group": group, "seq": seq,
                                 "calls": windows.calls, "window": i, "start_ns": start,
                                 "end_ns": end})

    def enter(self, node: int) -> None:
        if self._step is not None and not self.replaying:
            rf = _open_range(self._range_names[node])
            self._stack.append((node, self.timer.mark(), rf))

    def exit(self, node: int) -> None:
        if self._step is None or self.replaying:
            return
        end = self.timer.mark()
        stack = self._stack
        if stack and stack[-1][0] == node:
            _, start, rf = stack.pop()
        else:  # an exception unwound past a hook, or calls in an unexpected order
            self.anomalies += 1
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] == node:
                    start, rf = stack[i][1], stack[i][2]
                    for _, _, inner in stack[i + 1:]:
                        if inner is not None:
                            inner.__exit__(None, None, None)
                    del stack[i:]
                    break
            else:
                return
        if rf is not None:
            rf.__exit__(None, None, None)
        self._step.modules.append((node, start, end))

    def enclosing(self) -> int | None:
        return self._stack[-1][0] if self._stack else None

    # --------------------------------------------------------------- collectives
    def collective_begin(self) -> Any | None:
        """Arrival mark of a collective, or None when this call is not to be recorded (no step
        open, or nested inside another recorded collective)."""
        if self._step is None or getattr(self._local, "depth", 0) or self.replaying:
            return None
        self._local.depth = 1
        return self.timer.mark()

    def collective_end(self, arrival: Any, op: str, group: str, world_size: int,
                       rank_in_group: int, peer: int | None, nbytes: int, dtype: str,
                       is_async: bool) -> int | None:
        """Records the call; returns its `seq` (None when no step is open)."""
        self._local.depth = 0
        completion = self.timer.mark()
        step = self._step
        if step is None:
            return None
        if peer is None:
            key = (group, -1, -1)
        else:
            key = (group, min(rank_in_group, peer), max(rank_in_group, peer))
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        step.collectives.append((op, group, world_size, rank_in_group, peer, seq, nbytes, dtype,
                                 arrival, completion, self.enclosing(), is_async))
        return seq

    def collective_abort(self) -> None:
        self._local.depth = 0

    # --------------------------------------------------------------- records
    def _records_of(self, step: _Step) -> Callable[[], list[dict[str, Any]]]:
        nodes, timer, counter = self.nodes, self.timer, self.counter

        def build() -> list[dict[str, Any]]:
            if step.batch is not None and counter is not None:
                (step.prefill_tokens, step.decode_tokens, step.num_reqs, step.context_tokens,
                 step.attended_pairs, step.sampled_rows) = counter(step.batch)
                step.batch = None
            t = timer.resolver(step.start_ns, step.start)
            end_ns = t(step.end)
            timer.step_done(step.end, end_ns)
            tokens = {"prefill_tokens": step.prefill_tokens, "decode_tokens": step.decode_tokens}
            records: list[dict[str, Any]] = [{
                "kind": "step", "step": step.index, "start_ns": t(step.start),
                "end_ns": end_ns, **tokens, "num_reqs": step.num_reqs,
                "context_tokens": step.context_tokens, "attended_pairs": step.attended_pairs,
                "sampled_rows": step.sampled_rows, "replay_ns": step.replay_ns,
                "worker_ns": step.step_time.ns() if step.step_time is not None else 0}]
            for index, start, end in step.modules:
                node = nodes[index]
                records.append({"kind": "module", "step": step.index, "node": node.id,
                                "type": node.type, "layer": node.layer, "start_ns": t(start),
                                "end_ns": t(end), **tokens})
            for (op, group, world, rank, peer, seq, nbytes, dtype, arrival, completion,
                 inside, is_async) in step.collectives:
                records.append({
                    "kind": "collective", "step": step.index, "op": op, "group": group,
                    "world_size": world, "rank_in_group": rank, "peer": peer, "seq": seq,
                    "bytes": nbytes, "dtype": dtype, "arrival_ns": t(arrival),
                    "completion_ns": t(completion),
                    "node": nodes[inside].id if inside is not None else None,
                    "async": is_async})
            records.extend(step.samples)  # host clock (perf_counter_ns) already
            return records

        return build
