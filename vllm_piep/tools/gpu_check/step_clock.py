"""Section 3: the CUDA-event step clock (`runtime/worker/steptime.py`) on the GPU: against wall
time, over steps queued without a host sync, through pickling, and its host cost per step."""

from __future__ import annotations

import pickle
import statistics
import time
from collections import deque
from typing import Any

from vllm_piep.runtime.worker.steptime import CudaStepClock, CudaStepTime, KnownStepTime
from vllm_piep.tools.gpu_check.backend import Burner
from vllm_piep.tools.gpu_check.context import Context

WALL_TOLERANCE = (0.02, 0.1e-3)  # relative, absolute (s)
QUEUED_TOLERANCE = 0.005
HOST_COST_US = 20.0
QUEUED_STEP_S = 0.002
LEAD_S = 0.2
LAG = 8  # steps between a step's end and the engine reading it


def synchronized_steps(ctx: Context, clock: CudaStepClock, burner: Burner) -> None:
    backend, report = ctx.backend, ctx.report
    for ms in backend.scale.clock_steps_ms:
        ops = burner.ops_for(ms / 1e3)
        rows = []
        for _ in range(backend.scale.clock_repeats):
            backend.sync()
            t0 = time.perf_counter_ns()
            clock.begin()
            burner.run(ops)
            step = clock.end()
            backend.sync()
            wall = (time.perf_counter_ns() - t0) / 1e9
            assert step is not None
            rows.append((step.ns() / 1e9, wall))
        # Over the median step: one step the host was preempted in is not the clock's error.
        excess = statistics.median(abs(event - wall) - (WALL_TOLERANCE[0] * wall
                                                        + WALL_TOLERANCE[1])
                                   for event, wall in rows)
        report.figure(f"synchronized_{ms:g}ms", [{"event_s": e, "wall_s": w} for e, w in rows])
        report.check(f"a synchronized ~{ms:g} ms step's event time is its wall time",
                     {"event_s": [e for e, _ in rows], "wall_s": [w for _, w in rows]},
                     f"median |event - wall| <= {WALL_TOLERANCE[0]:.0%} of wall + "
                     f"{WALL_TOLERANCE[1] * 1e3:g} ms", excess <= 0, host_timing=True)


def queued_steps(ctx: Context, clock: CudaStepClock, burner: Burner) -> None:
    """Steps launched back to back, read afterwards: their intervals, placed on one axis by
    the steps' own events against a reference event, are disjoint and add up to the span."""
    backend, report = ctx.backend, ctx.report
    ops = burner.ops_for(QUEUED_STEP_S)
    reference = backend.event()
    backend.sync()
    reference.record()
    # Work ahead of the steps, so that the host stalling between two launches (another
    # process on its core) leaves no gap in the GPU's queue: the clock is measured, not the host.
    burner.run(burner.ops_for(LEAD_S))
    steps: list[CudaStepTime] = []
    for _ in range(backend.scale.queued_steps):
        clock.begin()
        burner.run(ops)
        step = clock.end()
        assert isinstance(step, CudaStepTime)
        steps.append(step)
    backend.sync()
    # The steps' own events (read before `ns()` gives them back to the clock's pool).
    bounds = [(reference.elapsed_time(s._start), reference.elapsed_time(s._end))  # noqa: SLF001
              for s in steps]
    durations = [s.ns() / 1e6 for s in steps]  # ms
    overlaps = sum(1 for (_, end), (start, _) in zip(bounds, bounds[1:], strict=False)
                   if start < end - 1e-3)
    span = bounds[-1][1] - bounds[0][0]  # first step's start to last step's end
    total = sum(durations)
    report.figure("queued", {"steps": len(steps), "span_ms": span, "sum_ms": total,
                             "overlapping_pairs": overlaps})
    report.check("queued steps' intervals are disjoint", overlaps,
                 "no step starts before the previous one ends (1 µs tolerance)", overlaps == 0)
    report.check("queued steps add up to first start -> last end", total / span,
                 f"sum / span within 1 ± {QUEUED_TOLERANCE:g}",
                 abs(total / span - 1) <= QUEUED_TOLERANCE)


def pickled(ctx: Context, clock: CudaStepClock, burner: Burner) -> None:
    found: dict[str, Any] = {}
    ok = True
    for when in ("unread", "read"):
        clock.begin()
        burner.run(1)
        step = clock.end()
        assert step is not None
        if when == "read":
            ctx.backend.sync()
            step.ns()
        copy = pickle.loads(pickle.dumps(step))
        found[when] = {"type": type(copy).__name__, "ns": copy.ns(), "original_ns": step.ns()}
        ok &= isinstance(copy, KnownStepTime) and copy.ns() == step.ns() and copy.ns() > 0
    ctx.report.check("a pickled step time keeps its nanoseconds", found,
                     "a KnownStepTime with the same ns, read or not before pickling", ok)


def host_cost(ctx: Context, clock: CudaStepClock) -> None:
    """begin() and end() on the host, per step, with the engine reading steps LAG behind."""
    import torch

    backend = ctx.backend
    x = torch.randn(64, 64, device=backend.device, dtype=backend.dtype)
    pending: deque[Any] = deque()
    costs = []
    clock_ns = time.perf_counter_ns
    for _ in range(backend.scale.host_cost_steps):
        t0 = clock_ns()
        clock.begin()
        t1 = clock_ns()
        x @ x
        t2 = clock_ns()
        step = clock.end()
        t3 = clock_ns()
        costs.append((t1 - t0 + t3 - t2) / 1e3)
        pending.append(step)
        if len(pending) > LAG:
            pending.popleft().ns()
    while pending:
        pending.popleft().ns()
    median = statistics.median(costs)
    p90 = statistics.quantiles(costs, n=10)[-1]
    ctx.report.figure("host_cost_us", {"median": median, "p90": p90, "steps": len(costs)})
    # A dry run times the stand-in's events on a shared CPU: reported, not gated.
    ctx.report.check("begin + end cost on the host per step", median,
                     f"median <= {HOST_COST_US:g} µs",
                     None if ctx.backend.dry_run else median <= HOST_COST_US)


def run(ctx: Context) -> None:
    errors: list[BaseException] = []
    clock = CudaStepClock(on_error=errors.append)
    burner = ctx.backend.burner(ctx.backend.scale.burn_n)
    ctx.report.figure("work_unit_s", burner.op_s)
    synchronized_steps(ctx, clock, burner)
    queued_steps(ctx, clock, burner)
    pickled(ctx, clock, burner)
    host_cost(ctx, clock)
    ctx.report.check("the clock reported no CUDA error", [repr(e) for e in errors], "none",
                     not errors)
