"""The plugin's cost to the engine core, per engine step, as an operator sees it: its time on the
busy loop's critical path (a step's output to the next dispatch) and in all (every thread), how
long it holds the interpreter at a stretch, how late that makes another thread, and whether a
finishing output leaves in a later batch than without it.

In this process: vLLM's engine loop is played step after step with the plugin's real wrappers of
`Scheduler.schedule`, `get_grammar_bitmask` and `update_from_output` around stand-in originals
that hand back prebuilt scheduler states (`tests/support/engine_loop.py`: a decode batch of `n`
requests with ~100 tokens of context; each step ~1 % of them end, ~0.25 % are aborted from
outside through a stand-in `finish_requests`, and as many new 32-token prompts join, so
prefills, finishes and aborts all occur; each scheduler output names what finished since the
last, `finished_req_ids`), real vLLM `EngineCoreOutput(s)`, and a real output thread that
serializes each batch with vLLM's `MsgpackEncoder.encode_into` through the plugin's wrapper.
After schedule the loop calls get_grammar_bitmask (where vLLM calls it, right after dispatch),
then sleeps `--step-ms` (the GPU's time: the GIL is free, as while vLLM waits on the device;
`--device-wait spin` waits busy instead, with a system call per turn, `poll` busy without one,
`none` not at all, to tell the plugin's own cost from what a core that idled between steps
makes of it), then updates; with async scheduling the next step is scheduled
before the update. The predictors are the tiny model's analytic prior and the shipped calibrated
bundle, loaded as the engine loads them. The same steps run in two lanes, through the plugin's
wrappers and through the bare originals, in turns of 50 steps (`engine_loop.in_turns`), each as
an engine runs, the same calls step after step; the first turn (the predictor's loading) is not
counted. The played engine keeps every output it sent, for the checks below; the garbage
collector's permanent generation takes them every turn (`gc.freeze`), so that its full
collections do not walk what a served engine would have dropped.

The cells, per batch and schedule (sync, async):
- "inside step": the reference, the dense engine predicting every step whole through the ONNX
  step graph (`EngineAccountant(split_rule=False)`), its calls run inside the step, a row on
  every output;
- "served": the engine core as served (calls queued off the loop, sparse rows, the split rule
  and its closed form for decode runs), with the prior and the bundle; in measured mode (the
  engine meter's thread over the stand-in NVML counter, `tests/support/standin_nvml.py`, 20 ms
  updates); and on three more workloads with the prior: stop strings on 20 % of new requests
  ("stop"), ngram-like speculative tokens on 20 % of decode steps ("spec"), and `Rich()`'s
  chunked prefill, prefix-cache hits, preemption and speculative tokens ("rich");
- "floor": the loop played with `FloorWrappers`, the least any wrapper that queues the step's
  work for later does (per wrapped call a dict lookup, a clock read, a deque append). On a VM,
  code that runs right after the loop's wait on the device can run many times slower than warm
  code: the floor says what the machine makes of the critical path at that moment.

Reported per cell:
- critical path: the median step's schedule + update + finish with the plugin minus without,
  with a bootstrapped 95 % CI (`added`); total: the mean added on the loop (critical path and
  get_grammar_bitmask, in the device's shadow) plus the plugin's CPU on the output thread and on
  the meter thread, per step;
- stretches: each entry of the plugin's code on any thread (the loop's wrappers,
  `DeferredCalls.run` wherever it runs, which is the encode wrapper's accounting on the output
  thread, the meter thread's `tick`), timed from entry to return with `perf_counter_ns` less
  its waits for the accountant's lock (the GIL is free then): what the plugin holds the
  interpreter for at a stretch, median, p90, p99 and the longest. Both lanes' loop calls go
  through the same timer, so that its cost cancels in their difference;
- lateness: a thread that sleeps 100 µs in a loop during the run and records how late it
  wakes, by the lane the loop is playing then (the plugin's or the bare one): the GIL another
  thread holds when it wakes shows as lateness (its floor is the OS's wake-up latency);
- finish lag: for every output that finishes a request, the engine step whose batch carried it
  in the cell minus in the reference on the same workload (measured mode holds a finishing
  output until the meter's reading covers its steps; prediction mode holds none);
- the closed form's counts (`regular_steps`, `audits`, `audit_failures`).

Prediction mode also checks that every served cell's outputs go out in the reference's batches,
that only the outputs that finish a request or whose request has stop strings carry a row, and
that each row equals the reference's on the same output to 1e-9 (`rows_match`). The stop-string
cell is checked against the plain workload's reference: the scheduler states are the same, and a
dense engine's rows do not depend on which requests have stop strings.

    .venv/bin/python benchmarks/engine_loop_cost.py --steps 2000 --json
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from predictor_cost import load_both
from serve_overhead import ROOT, finish_run, header, json_option, verdict
from tqdm import tqdm

sys.path.insert(0, str(ROOT / "tests" / "support"))

from engine_loop import (  # noqa: E402
    BLOCK,
    SETTLE,
    PlayedEngine,
    Rich,
    Workload,
    poll_wait,
    spin_wait,
)
from standin_nvml import meter as standin_meter  # noqa: E402

from vllm_piep.runtime.engine_core.accountant import EngineAccountant  # noqa: E402
from vllm_piep.runtime.engine_core.deferred import DeferredCalls  # noqa: E402
from vllm_piep.runtime.engine_core.measured import EngineMeter  # noqa: E402

# Targets: the added CPU per step on the loop's critical path; in all (critical path, the
# device's shadow, the output thread, the meter thread), by mode and batch, in every served
# cell (prior and bundle, every workload), where the loop waits for the device busy or not at
# all, and at batch 64 where it sleeps; the longest stretch of the plugin's code on any
# thread; finishing outputs in the reference's batch (prediction mode).
PATH_TARGET_US = 20.0
TOTAL_TARGETS_US = {("predicted", 64): 50.0, ("predicted", 256): 100.0,
                    ("measured", 64): 75.0, ("measured", 256): 125.0}
SLEEPING_TARGET_US = 150.0  # batch 64, the loop sleeping between steps (`--device-wait sleep`)
STRETCH_TARGET_US = 100.0
PROBE_S = 100e-6  # the lateness probe's sleep
# How the loop waits for the device (`--device-wait`).
DEVICE_WAITS: dict[str, Callable[[float], None]] = {
    "sleep": time.sleep, "spin": spin_wait, "poll": poll_wait, "none": lambda seconds: None}

# What times the loop's calls and the stretches (`--clock`).
CLOCKS: dict[str, Callable[[], int]] = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
# The workloads, as `Workload` options.
WORKLOADS: dict[str, dict[str, Any]] = {
    "plain": {},
    "stop": {"stop_p": 0.2},
    "spec": {"rich": Rich(spec_p=0.2, preempt_p=0.0, prefix_hit_p=0.0, chunk=1 << 30,
                          prompt=(32, 32))},
    "rich": {"rich": Rich()},
}


class Cell(NamedTuple):
    """One engine run per batch and schedule (module docstring)."""

    work: str  # a key of WORKLOADS
    pred: str  # "prior", "bundle" or "none" (the floor)
    mode: str  # "predicted", "measured" or "floor"
    placement: str  # "inside step" (the reference), "served" or "queued" (the floor)

    def reference(self) -> Cell | None:
        """The reference run a served cell is checked against."""
        if self.placement != "served":
            return None
        return Cell("plain" if self.work == "stop" else self.work, self.pred, "predicted",
                    "inside step")


CELLS = [Cell("plain", "prior", "predicted", "inside step"),
         Cell("plain", "prior", "predicted", "served"),
         Cell("plain", "prior", "measured", "served"),
         Cell("plain", "bundle", "predicted", "inside step"),
         Cell("plain", "bundle", "predicted", "served"),
         Cell("stop", "prior", "predicted", "served"),
         Cell("spec", "prior", "predicted", "inside step"),
         Cell("spec", "prior", "predicted", "served"),
         Cell("rich", "prior", "predicted", "inside step"),
         Cell("rich", "prior", "predicted", "served"),
         Cell("plain", "none", "floor", "queued")]


class Stretches:
    """The plugin's uninterrupted stretches on every thread (module docstring), in ns, and where
    each ran. An entry inside another counts in the outer one. Recorded from the plugin lane's
    second turn (the first loads the predictor) until `closed`."""

    def __init__(self, engine: PlayedEngine, clock: Callable[[], int] = time.perf_counter_ns
                 ) -> None:
        self.engine = engine
        self.clock = clock
        self.local = threading.local()
        self.ns: list[int] = []
        self.where: list[str] = []
        self.closed = False

    def timed(self, name: str, call: Callable[..., Any], keep: bool = True
              ) -> Callable[..., Any]:
        """`call` timed (`keep`: recorded; else timed alike and dropped, for the bare lane)."""
        local, clock, engine = self.local, self.clock, self.engine
        ns, where = self.ns, self.where

        def entry(*args: Any) -> Any:
            depth = getattr(local, "depth", 0)
            if depth:
                local.depth = depth + 1
                try:
                    return call(*args)
                finally:
                    local.depth = depth
            local.depth, local.waited = 1, 0
            t0 = clock()
            try:
                return call(*args)
            finally:
                spent = clock() - t0 - local.waited
                local.depth = 0
                if keep and not self.closed and engine.steps_updated >= BLOCK:
                    ns.append(spent)
                    where.append(name)

        return entry

    def waited(self, ns: int) -> None:
        """This thread waited `ns` without the GIL inside the entry it is in."""
        if getattr(self.local, "depth", 0):
            self.local.waited += ns

    def summary(self) -> dict[str, Any]:
        if not self.ns:
            return {"count": 0}
        us = np.asarray(self.ns) / 1e3
        longest = int(np.argmax(us))
        return {"count": len(us), "median_us": float(np.median(us)),
                "p90_us": float(np.percentile(us, 90)), "p99_us": float(np.percentile(us, 99)),
                "max_us": float(us[longest]), "longest_in": self.where[longest]}


class TimedLock:
    """The accountant's lock, telling `Stretches` how long each acquisition waited."""

    def __init__(self, lock: Any, stretches: Stretches) -> None:
        self.lock, self.stretches = lock, stretches

    def __enter__(self) -> TimedLock:
        clock = self.stretches.clock
        t0 = clock()
        self.lock.acquire()
        self.stretches.waited(clock() - t0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def time_plugin_threads(acc: EngineAccountant, stretches: Stretches) -> None:
    """`DeferredCalls.run`, wherever it runs, and the accountant's lock, timed (before the
    loop's first call: its handle keeps the deferred calls it finds)."""
    timed_run: Callable[[], int] | None = None

    class TimedDeferred(DeferredCalls):
        def run(self) -> int:
            assert timed_run is not None
            return timed_run()

    deferred = TimedDeferred(acc._deferred_failed)
    timed_run = stretches.timed("deferred calls", partial(DeferredCalls.run, deferred))
    acc.deferred = deferred
    acc.lock = TimedLock(acc.lock, stretches)  # type: ignore[assignment]


class Lateness:
    """A thread that sleeps `PROBE_S` in a loop and records how late it wakes (ns), by the lane
    the loop is playing then (True: the plugin's), from the plugin lane's second turn."""

    def __init__(self, engine: PlayedEngine) -> None:
        self.engine = engine
        self.late: dict[bool, list[int]] = {True: [], False: []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lateness-probe", daemon=True)

    def _run(self) -> None:
        clock, sleep, engine, late = time.perf_counter_ns, time.sleep, self.engine, self.late
        period_ns = int(PROBE_S * 1e9)
        while not self._stop.is_set():
            t0 = clock()
            sleep(PROBE_S)
            ns = clock() - t0 - period_ns
            if engine.steps_updated >= BLOCK:
                late[engine.phase != "bare"].append(ns)

    def __enter__(self) -> Lateness:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for plugin, lane in ((True, "plugin"), (False, "bare")):
            us = np.asarray(self.late[plugin]) / 1e3
            out[lane] = ({"count": len(us), "median_us": float(np.median(us)),
                          "p99_us": float(np.percentile(us, 99)), "max_us": float(us.max())}
                         if len(us) else {"count": 0})
        return out


def start_meter(acc: EngineAccountant, engine: PlayedEngine, stretches: Stretches
                ) -> EngineMeter:
    """Measured mode: the engine meter's thread over the stand-in NVML counter, its `tick`
    timed, once it switched the accountant to measured mode."""
    engine_meter = EngineMeter(acc, standin_meter, "standin", lambda: 10.0, engine.put_outputs)
    tick = stretches.timed("meter tick", engine_meter.tick)
    engine_meter.tick = tick  # type: ignore[method-assign]
    acc.engine_meter = engine_meter.start()
    deadline = time.monotonic() + 10
    while acc.splitter is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if acc.splitter is None:
        raise SystemExit("the stand-in meter did not open")
    return engine_meter


def stop_meter(acc: EngineAccountant, engine_meter: EngineMeter, timeout_s: float = 10.0
               ) -> None:
    """The engine idle: the meter's thread settles and sends the outputs it holds, then stops."""
    deadline = time.monotonic() + timeout_s
    while (engine_meter.held or len(acc.deferred)) and time.monotonic() < deadline:
        time.sleep(0.01)
    engine_meter.stop()


def play(predictor: Any, n: int, steps: int, step_ms: float, async_scheduling: bool,
         cell: Cell, seed: int, device_wait: Callable[[float], None] = time.sleep,
         clock: Callable[[], int] = time.perf_counter_ns, inline: bool = False
         ) -> dict[str, Any]:
    """One engine run of `cell`; µs of plugin time on the loop per step, on the output and
    meter threads, its stretches, the probe's lateness, and what went out
    (`device_wait(seconds)`: the loop's wait for the device; `clock`: what times the loop's
    calls and the stretches, wall time or each thread's CPU time; `inline`: a served cell's
    calls run inside the step, as where no output thread runs them, to tell their own cost
    from the hand-offs between the loop and the output thread)."""
    acc = EngineAccountant(lambda: predictor, split_rule=cell.placement != "inside step")
    acc.sparse = cell.placement == "served"
    engine = PlayedEngine(acc, Workload(n, seed, **WORKLOADS[cell.work]),
                          cell.placement != "inside step" and not inline,
                          int(step_ms * 1e6))
    stretches = Stretches(engine, clock)
    time_plugin_threads(acc, stretches)
    engine_meter = start_meter(acc, engine, stretches) if cell.mode == "measured" else None
    meter_clock = (time.pthread_getcpuclockid(engine_meter._thread.ident)
                   if engine_meter is not None and engine_meter._thread is not None
                   and engine_meter._thread.ident is not None else None)
    meter_ns0 = time.clock_gettime_ns(meter_clock) if meter_clock is not None else 0
    waits = 0

    def device() -> None:
        # The played engine keeps every output it sent, for the checks (a served engine drops
        # them once sent): frozen every turn, the collector does not walk them.
        nonlocal waits
        waits += 1
        if waits % BLOCK == 0:
            gc.freeze()
        device_wait(step_ms / 1e3)

    wall0 = time.perf_counter_ns()
    with Lateness(engine) as lateness:
        times = engine.run(steps, async_scheduling, device, cell.mode == "floor",
                           lambda plugin, name, call: stretches.timed(name, call, plugin),
                           clock)
    stretches.closed = True
    wall_ns = time.perf_counter_ns() - wall0
    meter_ns = (time.clock_gettime_ns(meter_clock) - meter_ns0) if meter_clock is not None else 0
    if engine_meter is not None:
        stop_meter(acc, engine_meter)
    engine.close()
    first = BLOCK - SETTLE  # the first turn loads the predictor: not counted
    us = {k: np.asarray(getattr(times, k)[first:]) / 1e3 for k in times._fields}
    output_ns = engine.output_thread_ns[BLOCK:steps]
    # The meter thread runs by the clock: its CPU per second of the run, per plugin step's
    # second (the lanes take turns, so the plugin's steps fill about half the run).
    plugin_s = (float(np.sum(us["plugin"]) + np.sum(us["plugin_shadow"])) / 1e6
                + len(us["plugin"]) * step_ms / 1e3)
    return {"us": us, "engine": engine, "acc": acc, "stretches": stretches.summary(),
            "lateness": lateness.summary(),
            "output_thread_us": float(np.mean(output_ns)) / 1e3 if output_ns else 0.0,
            "meter_us": meter_ns / 1e3 / (wall_ns / 1e9) * plugin_s / len(us["plugin"])}


def rows_match(reference: PlayedEngine, served: PlayedEngine, rtol: float = 1e-9) -> bool:
    """Every output the served engine sent went out in the same batch as the reference's; it
    carries a row if and only if it finishes its request or its request has stop strings; and
    each row equals the reference's on the same output, field by field, to `rtol` (and 1e-12
    of the reference's total energy)."""
    ours, theirs = served.sent(), reference.sent()
    if ours.keys() != theirs.keys():
        return False
    finishing = {out.request_id for outs in served.batches for out in outs
                 if out.finish_reason is not None}
    with_stop = served.work.with_stop
    atol = 1e-12 * reference.acc.total_joules
    for (req_id, k), (batch, row) in ours.items():
        their_batch, their_row = theirs[req_id, k]
        last = (req_id, k + 1) not in ours
        wanted = (last and req_id in finishing) or req_id in with_stop
        if batch != their_batch or (row is not None) != wanted:
            return False
        if row is not None and (their_row is None or not np.allclose(
                np.frombuffer(row, np.float64), np.frombuffer(their_row, np.float64),
                rtol=rtol, atol=atol)):
            return False
    return True


def finish_lag(reference: PlayedEngine, served: PlayedEngine) -> dict[str, float | int]:
    """Per request that finished with an output in the reference: the step after which the
    served engine queued its finishing output minus the reference's (`max`, `mean`), and how
    many the served engine never sent (`missing`)."""
    theirs, ours = reference.finish_steps(), served.finish_steps()
    lags = np.array([ours[r] - s for r, s in theirs.items() if r in ours], dtype=np.int64)
    return {"max": int(lags.max()) if len(lags) else 0,
            "mean": float(lags.mean()) if len(lags) else 0.0,
            "finished": len(theirs), "missing": len(theirs.keys() - ours.keys())}


def mean_added(plugin: np.ndarray, bare: np.ndarray, rounds: int = 2000, seed: int = 0
               ) -> tuple[float, float, float]:
    """What the plugin adds per step on average: the mean with it minus the mean without, and
    the difference's bootstrapped 95 % CI."""
    rng = np.random.default_rng(seed)
    diffs = (rng.choice(plugin, size=(rounds, len(plugin))).mean(axis=1)
             - rng.choice(bare, size=(rounds, len(bare))).mean(axis=1))
    return (float(plugin.mean() - bare.mean()),
            float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5)))


def added(plugin: np.ndarray, bare: np.ndarray, rounds: int = 2000, seed: int = 0
          ) -> tuple[float, float, float]:
    """What the plugin adds per step: the median with it minus the median without, and the
    difference's bootstrapped 95 % CI."""
    rng = np.random.default_rng(seed)
    diffs = (np.median(rng.choice(plugin, size=(rounds, len(plugin))), axis=1)
             - np.median(rng.choice(bare, size=(rounds, len(bare))), axis=1))
    return (float(np.median(plugin) - np.median(bare)),
            float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5)))


def loop_options(parser: argparse.ArgumentParser) -> None:
    """The played engine loop's options, shared by the benchmarks that play it."""
    parser.add_argument("--batches", default="64,256", help="requests per step (default 64,256)")
    parser.add_argument("--steps", type=int, default=2000, help="engine steps per run")
    parser.add_argument("--step-ms", type=float, default=5.0,
                        help="the device's time per step (default 5 ms, a GPU decode step)")


def cost_of(run: dict[str, Any]) -> dict[str, Any]:
    """A run's figures (µs per step; module docstring)."""
    us, acc = run["us"], run["acc"]
    median, low, high = added(us["plugin"], us["bare"])
    loop_plugin = us["plugin"] + np.resize(us["plugin_shadow"], len(us["plugin"]))
    loop_bare = us["bare"] + np.resize(us["bare_shadow"], len(us["bare"]))
    loop_mean, loop_low, loop_high = mean_added(loop_plugin, loop_bare)
    threads = run["output_thread_us"] + run["meter_us"]
    return {"path_median_us": median, "path_ci95_us": [low, high],
            "path_p90_us": float(np.percentile(us["plugin"], 90)
                                 - np.percentile(us["bare"], 90)),
            "loop_mean_us": loop_mean, "loop_ci95_us": [loop_low, loop_high],
            "output_thread_us": run["output_thread_us"], "meter_thread_us": run["meter_us"],
            "total_us": loop_mean + threads,
            "total_ci95_us": [loop_low + threads, loop_high + threads],
            "shadow_median_us": added(us["plugin_shadow"], us["bare_shadow"])[0],
            "stretches": run["stretches"],
            "longest_stretch_us": run["stretches"].get("max_us", 0.0),
            "lateness_us": run["lateness"],
            "closed_form": {"regular_steps": acc.regular_steps, "audits": acc.audits,
                            "audit_failures": acc.audit_failures},
            "steps": len(us["plugin"]), "tracked_after": acc.tracked_requests,
            "errors": acc.errors}


def total_target(n: int, cell: Cell, device_wait: str) -> float | None:
    if device_wait == "sleep":
        return SLEEPING_TARGET_US if n == 64 else None
    return TOTAL_TARGETS_US.get((cell.mode, n))


def marks(r: dict[str, Any], n: int, cell: Cell, floor: dict[str, Any] | None,
          device_wait: str = "spin") -> str:
    """A served cell's verdicts against the targets."""
    path = r["path_median_us"]
    out = f"path ≤ {PATH_TARGET_US:.0f}: {verdict(path <= PATH_TARGET_US)}"
    if floor is not None:
        out += f" ({path - floor['path_median_us']:+.1f} above the floor)"
    target = total_target(n, cell, device_wait)
    if target is not None:
        out += f"; total ≤ {target:.0f}: {verdict(r['total_us'] <= target)}"
    if cell.mode == "predicted" and "finish_lag_batches" in r:
        lag = r["finish_lag_batches"]
        out += f"; finish lag 0: {verdict(lag['max'] == 0 and lag['missing'] == 0)}"
    stretch = r["longest_stretch_us"]
    return out + f"; longest stretch ≤ {STRETCH_TARGET_US:.0f}: " + verdict(
        stretch <= STRETCH_TARGET_US)


def lane_text(lane: dict[str, Any]) -> str:
    if not lane.get("count"):
        return "none"
    return f"{lane['median_us']:.0f}/{lane['p99_us']:.0f}/{lane['max_us']:.0f}"


def print_cell(key: str, r: dict[str, Any], verdicts: str) -> None:
    s = r["stretches"]
    print(f"  {key:<46} path {r['path_median_us']:6.1f} ({r['path_ci95_us'][0]:.1f}-"
          f"{r['path_ci95_us'][1]:.1f})  total {r['total_us']:7.1f} "
          f"({r['total_ci95_us'][0]:.1f}-{r['total_ci95_us'][1]:.1f}; output thread "
          f"{r['output_thread_us']:.1f}, meter {r['meter_thread_us']:.1f})")
    line = "    stretches "
    line += (f"{s['median_us']:.1f}/{s['p90_us']:.1f}/{s['p99_us']:.1f}/{s['max_us']:.0f} "
             f"(max in {s['longest_in']})" if s.get("count") else "none")
    late = r["lateness_us"]
    line += (f"; probe late {lane_text(late['plugin'])} plugin lane, "
             f"{lane_text(late['bare'])} bare")
    if "finish_lag_batches" in r:
        lag = r["finish_lag_batches"]
        line += f"; finish lag max {lag['max']}, mean {lag['mean']:.2f}"
        if lag["missing"]:
            line += f" ({lag['missing']} of {lag['finished']} never sent)"
    print(line)
    if verdicts:
        print(f"    {verdicts}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "tiny-llama")
    parser.add_argument("--bundle", type=Path, default=ROOT / "models" / "cpu-tiny-llama")
    loop_options(parser)
    parser.add_argument("--device-wait", choices=sorted(DEVICE_WAITS), default="sleep",
                        help="how the loop waits for the device: 'sleep' (the core idles, as "
                             "on a blocking CUDA event; the default), 'spin' (busy, the GIL "
                             "free, a sched_yield system call per turn, as CUDA's yielding "
                             "wait), 'poll' (busy, the GIL free, no system call, as CUDA's "
                             "spinning wait) or 'none' (back to back: the plugin's cost with "
                             "warm caches)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="what times the loop's calls and the plugin's stretches: 'wall' "
                             "(the default: what the engine waits) or 'cpu' (each thread's CPU "
                             "time: what the plugin costs, which other processes on a shared "
                             "machine do not stretch); the output and meter threads are "
                             "always timed by their CPU")
    parser.add_argument("--cells", default=None,
                        help="only these cells, comma-separated, each as "
                             "WORK/PREDICTOR/MODE/PLACEMENT as the output names them (e.g. "
                             "plain/prior/predicted/served,plain/none/floor/queued); a served "
                             "cell's reference runs with it. Default: all")
    parser.add_argument("--inline", action="store_true",
                        help="served cells run their accounting inside the step (no hand-off "
                             "to vLLM's output thread): what the calls cost by themselves")
    json_option(parser, "engine_loop_cost.json")
    args = parser.parse_args()
    cells = CELLS
    if args.cells is not None:
        names = {"/".join(cell): cell for cell in CELLS}
        wanted = [c.strip() for c in args.cells.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in names]
        if unknown or not wanted:
            parser.error(f"--cells: unknown cell {unknown[0] if unknown else '(none)'!r}; "
                         f"the cells are {', '.join(names)}")
        picked = {names[c] for c in wanted}
        picked |= {ref for c in picked if (ref := c.reference()) is not None}
        cells = [cell for cell in CELLS if cell in picked]
    info = header("plugin cost per engine step: critical path, all threads, stretches, "
                  "lateness, finish lag")
    predictors = load_both(args.model, args.bundle)
    batches = [int(b) for b in args.batches.split(",")]
    groups = [(n, sched) for n in batches for sched in ("sync", "async")]
    results: dict[str, Any] = {}
    identical: dict[str, bool] = {}
    progress = tqdm(total=len(groups) * len(cells), desc="engine runs", unit="run")
    for n, sched in groups:
        engines: dict[Cell, PlayedEngine] = {}
        keys: dict[Cell, str] = {}
        for cell in cells:
            # The earlier cells' records stay in memory; frozen, the collector no longer walks
            # them (a full collection over them took up to 0.5 s, inside whichever call it hit).
            gc.collect()
            gc.freeze()
            run = play(predictors.get(cell.pred), n, args.steps, args.step_ms,
                       sched == "async", cell, seed=n,
                       device_wait=DEVICE_WAITS[args.device_wait], clock=CLOCKS[args.clock],
                       inline=args.inline)
            keys[cell] = key = f"{n}/{cell.work}/{cell.pred}/{cell.mode}/{sched}/{cell.placement}"
            results[key] = cost_of(run)
            if cell.mode != "floor":
                engines[cell] = run["engine"]
            progress.update()
        for cell, key in keys.items():
            ref = cell.reference()
            if ref is None:
                continue
            results[key]["finish_lag_batches"] = finish_lag(engines[ref], engines[cell])
            if cell.mode == "predicted":
                identical[key] = rows_match(engines[ref], engines[cell])
        del engines
        gc.unfreeze()
    progress.close()
    print(f"\nplugin µs per engine step (device step {args.step_ms} ms, waited: "
          f"{args.device_wait}, timed by {args.clock} clock). Path: median (95 % "
          "CI), the step's output to the next dispatch. Total: mean (95 % CI) of the loop's "
          "critical path and its work in the device's shadow, plus the output thread's and the "
          "meter thread's plugin CPU per step. Stretches: the plugin's code at a stretch on any "
          "thread, median/p90/p99/max µs. Probe late: how late a thread sleeping "
          f"{PROBE_S * 1e6:.0f} µs wakes, median/p99/max µs, while the loop plays the plugin's "
          "lane or the bare one. Finish lag: a finishing output's step minus the reference's. "
          "'floor': the least a wrapper that queues the step's work costs here:")
    floors = {(k.split("/")[0], k.split("/")[4]): r for k, r in results.items()
              if "/floor/" in k}
    for key, r in results.items():
        n, work, pred, mode, sched, placement = key.split("/")
        cell = Cell(work, pred, mode, placement)
        verdicts = (marks(r, int(n), cell, floors.get((n, sched)), args.device_wait)
                    if placement == "served" else "")
        print_cell(key, r, verdicts)
    for key, same in identical.items():
        print(f"records, the reference vs {key}: "
              f"{'same batches, rows equal to 1e-9' if same else 'DIFFERENT'}")
    finish_run(info, args, {
        "us_per_step": results, "records_identical": identical,
        "path_target_us": PATH_TARGET_US, "stretch_target_us": STRETCH_TARGET_US,
        "total_targets_us": {f"{m}/{n}": t for (m, n), t in TOTAL_TARGETS_US.items()},
        "sleeping_target_us": SLEEPING_TARGET_US})
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
