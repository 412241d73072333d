"""Section 4: the prior against the GPU's own energy counter. Random-weight models of real
shapes run prefill and batched decode steps timed by CUDA events over windows of the counter;
per row the measured joules and watts beside the prior's predicted static and dynamic joules
for the same steps (`load_predictor` with the default configuration, the GPU as NVML names
it), and this GPU's static/FLOP/byte powers fitted from the rows."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_piep.config import PiepConfig
from vllm_piep.meters.gpus import gpu_facts, instance_gpus
from vllm_piep.model.components import STATIC
from vllm_piep.model.devices import GPU_SPECS, gpu_profile_key, power_fit
from vllm_piep.model.flops import StepBatch, step_work
from vllm_piep.predict.loader import load_predictor
from vllm_piep.tools.gpu_check import models
from vllm_piep.tools.gpu_check.backend import Scale
from vllm_piep.tools.gpu_check.context import NVML_CLOCK_SM, Context, nvml_call
from vllm_piep.tools.gpu_check.counter import CounterPoller
from vllm_piep.tools.gpu_check.nvml_section import require_whole_gpu
from vllm_piep.tools.gpu_check.report import one_line

RATIO_RANGE = (0.5, 2.0)  # predicted / measured
MODELS = ("llama-3.1-8b", "qwen3-30b-a3b")
FREE_FRACTION = 0.9  # of the GPU's free memory a model and its KV cache may take
WARMUP_STEPS = 2
MIN_STEPS = 5  # a window holds at least this many steps' time
WINDOW_TRIES = 3
# Rows whose GPU is in kernels at least this share of a step are gated; the others (eager
# launches of small batches, the GPU mostly idle) are reported: vLLM's CUDA-graph steps are not
# like them, and the prior prices vLLM's steps.
BUSY_GATE = 0.8
# NVML's clock event reasons (nvml.h: nvmlClocksEventReason*), by bit.
CLOCK_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap",
                 0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal",
                 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


def clock_state(nvml: Any, handle: Any) -> dict[str, Any]:
    reasons = nvml_call(nvml, "nvmlDeviceGetCurrentClocksEventReasons", handle)
    if reasons is None:
        reasons = nvml_call(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    return {"sm_clock_mhz": nvml_call(nvml, "nvmlDeviceGetClockInfo", handle, NVML_CLOCK_SM),
            "clock_reasons": None if reasons is None else
            [name for bit, name in CLOCK_REASONS.items() if int(reasons) & bit]}


class Row:
    """One workload's steps over one counter window."""

    def __init__(self, label: str, model: str) -> None:
        self.label, self.model = label, model
        self.steps: list[tuple[int, int, float, StepBatch]] = []  # host start, end, event s

    def run(self, ctx: Context, step: Callable[[], StepBatch],
            sample: Callable[[], None] | None = None) -> None:
        backend = ctx.backend
        start, end = backend.event(), backend.event()
        t0 = time.perf_counter_ns()
        start.record()
        batch = step()
        end.record()
        backend.sync()
        self.steps.append((t0, time.perf_counter_ns(), start.elapsed_time(end) / 1e3, batch))
        if sample is not None:
            sample()


def kernel_seconds(ctx: Context, step: Callable[[], StepBatch]) -> float:
    """The time one step's kernels run on the device (torch.profiler; a CPU's ops on a dry
    run). Held against the row's unprofiled step time, it says whether the row prices the
    prior or the harness: a step of eager launches leaves the GPU mostly idle. The profiler's
    own start, stop and launch overhead stay out of it: its kernel durations are the device's."""
    from torch.profiler import ProfilerActivity, profile

    cuda = ctx.backend.device == "cuda"
    ctx.backend.sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        ctx.backend.sync()
    events = prof.key_averages()
    return sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in events) / 1e6


def measure(ctx: Context, poller: CounterPoller, nvml: Any, handle: Any, predictor: Any,
            lm: models.LoadedModel, label: str, step: Callable[[], StepBatch]) -> dict[str, Any]:
    scale = ctx.backend.scale
    row = Row(label, lm.name)
    for _ in range(WARMUP_STEPS):
        t0 = time.perf_counter()
        step()
        ctx.backend.sync()
        step_s = time.perf_counter() - t0
    period = poller.period_s() or 0.1
    states: list[dict[str, Any]] = []  # clocks while the row runs, not after it
    # Long enough for the counter, and for whole steps to fall inside it.
    length = max(scale.window_s, scale.window_periods * period, MIN_STEPS * step_s)
    for _ in range(WINDOW_TRIES):  # steps slower than the warm-up's: a longer window
        row.steps.clear()
        window = poller.window(time.perf_counter_ns(), length, timeout_s=10.0 + 2 * step_s,
                               keep_busy=lambda: row.run(
                                   ctx, step, lambda: states.append(clock_state(nvml, handle))))
        inside = [s for s in row.steps
                  if s[0] >= window.start.t_ns and s[1] <= window.end.t_ns]
        if len(inside) >= 2:
            break
        longest = max(((s[1] - s[0]) / 1e9 for s in row.steps), default=length)
        length = max(2 * length, MIN_STEPS * longest)
    else:
        raise RuntimeError(f"{label}: fewer than two steps fell inside a counter window of "
                           f"{length:.2f} s")
    seconds = sum(s[2] for s in inside)
    # Profiled after the window, in the clocks and power state the row's steps ran in.
    busy = min(1.0, kernel_seconds(ctx, step) / (seconds / len(inside))) if seconds > 0 else None
    host_span = (inside[-1][1] - inside[0][0]) / 1e9
    static = dynamic = flops = mem = 0.0
    for _, _, step_s, batch in inside:
        _, joules = predictor.graph.run_batch(batch, step_s)
        static += float(joules[STATIC])
        dynamic += float(joules.sum() - joules[STATIC])
        work = step_work(lm.shape, batch)
        flops += float(work.flops.sum())
        mem += float(work.mem_bytes.sum())
    measured = window.watts * seconds
    predicted = static + dynamic
    return {"model": lm.name, "row": label, "layers": lm.shape.layers, "steps": len(inside),
            "window_s": window.seconds, "event_time_over_host_span": seconds / host_span,
            "step_ms": seconds / len(inside) * 1e3, "measured_watts": window.watts,
            "measured_joules": measured, "predicted_static_joules": static,
            "predicted_dynamic_joules": dynamic, "predicted_joules": predicted,
            "predicted_over_measured": predicted / measured if measured > 0 else math.nan,
            "flops_per_s": flops / seconds, "bytes_per_s": mem / seconds,
            # A CPU's op times (a dry run) say nothing of a GPU's launches: every row gated.
            "gpu_kernel_busy": busy, "gated": ctx.backend.dry_run or busy is None
            or busy >= BUSY_GATE,
            **(states[len(states) // 2] if states else clock_state(nvml, handle))}


def nnls3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: the best of the unconstrained fits over
    every subset of columns whose coefficients are all non-negative (exact: the optimum is
    the unconstrained fit on its own positive columns)."""
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(b ** 2))
    for mask in range(1, 2 ** a.shape[1]):
        cols = [j for j in range(a.shape[1]) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (coef < 0).any():
            continue
        residual = float(np.sum((a[:, cols] @ coef - b) ** 2))
        if residual < best_residual:
            best = np.zeros(a.shape[1])
            best[cols] = coef
            best_residual = residual
    return best


def fit_powers(rows: list[dict[str, Any]], peak_flops: float, bandwidth: float
               ) -> dict[str, float] | None:
    """Static, full-FLOP-rate and full-bandwidth watts from the rows' mean powers (non-negative
    least squares on relative error, as `calibrate fit-prior` fits published data)."""
    usable = [r for r in rows if math.isfinite(r["measured_watts"]) and r["measured_watts"] > 0]
    if len(usable) < 3:
        return None
    watts = np.array([r["measured_watts"] for r in usable])
    a = np.array([[1.0, r["flops_per_s"] / peak_flops, r["bytes_per_s"] / bandwidth]
                  for r in usable]) / watts[:, None]
    coef = nnls3(a, np.ones(len(usable)))
    fitted = a @ coef * watts
    return {"static_watts": float(coef[0]), "flop_watts": float(coef[1]),
            "byte_watts": float(coef[2]),
            "in_sample_mape": float(np.mean(np.abs(fitted / watts - 1)) * 100)}


def model_rows(ctx: Context, nvml: Any, handle: Any, name: str, gpu_name: str,
               facts: Any, rows: list[dict[str, Any]]) -> None:
    """The rows of one model, built to fit the GPU with the largest decode batch's cache, and
    freed afterwards whatever happened."""
    scale, backend = ctx.backend.scale, ctx.backend
    cache_len = scale.decode_context + scale.decode_positions
    config = models.config_of(name, backend.model_variant)
    layers = models.layers_that_fit(config, int(backend.free_memory() * FREE_FRACTION),
                                    max(scale.decode_batches), cache_len)
    lm = models.build(backend, name, layers)
    if layers < int(config["num_hidden_layers"]):
        lm.notes.append(f"{layers} of {config['num_hidden_layers']} layers (GPU memory)")
    try:
        predictor = load_predictor(PiepConfig(), lm.shape, "cuda", gpu_name, lm.architecture,
                                   gpu_facts=lambda: facts)
        ctx.report.figure(f"model_{name}", {
            "layers": layers, "notes": lm.notes, "architecture": lm.architecture,
            "predictor": predictor.bundle_id, "static_watts": predictor.profile.static_watts,
            "profile_source": predictor.profile.source})
        with CounterPoller(nvml, handle) as poller:
            for label, make in workloads(lm, scale):
                rows.append(measured_row(ctx, poller, nvml, handle, predictor, lm, label, make))
                ctx.report.figure("rows", rows)
    finally:
        lm.release()


def workloads(lm: models.LoadedModel, scale: Scale
              ) -> list[tuple[str, Callable[[], Callable[[], StepBatch]]]]:
    """(label, what makes the row's step function) per row: prefill, then decode."""
    found: list[tuple[str, Callable[[], Callable[[], StepBatch]]]] = []
    for requests, tokens in scale.prefill:
        def prefill(requests: int = requests, tokens: int = tokens) -> Callable[[], StepBatch]:
            run, batch = lm.prefill(requests, tokens)
            return lambda: (run(), batch)[1]
        found.append((f"prefill {requests}x{tokens}", prefill))
    for batch in scale.decode_batches:
        def decode(batch: int = batch) -> Callable[[], StepBatch]:
            return lm.decoder(batch, scale.decode_context, scale.decode_positions).step
        found.append((f"decode batch {batch} at context {scale.decode_context}", decode))
    return found


def measured_row(ctx: Context, poller: CounterPoller, nvml: Any, handle: Any, predictor: Any,
                 lm: models.LoadedModel, label: str,
                 make: Callable[[], Callable[[], StepBatch]]) -> dict[str, Any]:
    """One row, or its error in one line (the next row runs); its memory freed after it."""
    import torch

    try:
        return measure(ctx, poller, nvml, handle, predictor, lm, label, make())
    except Exception as exc:  # noqa: BLE001  (this row's failure; the next runs)
        memory = "out of GPU memory: " if isinstance(exc, torch.cuda.OutOfMemoryError) else ""
        return {"model": lm.name, "row": label, "error": memory + one_line(exc)}
    finally:
        if ctx.backend.device == "cuda":
            torch.cuda.empty_cache()


def run(ctx: Context) -> None:
    report = ctx.report
    identity = ctx.backend.identity(0)
    rows: list[dict[str, Any]] = []
    with ctx.nvml() as nvml:
        gpu = instance_gpus(nvml, [0], {0: identity})[0]
        require_whole_gpu(nvml, gpu.handle)
        facts = gpu_facts(nvml, gpu)
        report.figure("gpu", gpu.name)
        for name in MODELS:
            try:
                model_rows(ctx, nvml, gpu.handle, name, gpu.name, facts, rows)
            except Exception as exc:  # noqa: BLE001  (one model's failure; the other runs)
                rows.append({"model": name, "row": "(the model)", "error": one_line(exc)})
                report.figure("rows", rows)
    measured = [r for r in rows if "error" not in r]
    errors = [f"{r['model']} {r['row']}: {r['error']}" for r in rows if "error" in r]
    report.check("every row measured", errors, "no row failed", not errors)
    finite = all(math.isfinite(r[k]) for r in measured
                 for k in ("measured_joules", "measured_watts", "predicted_static_joules",
                           "predicted_dynamic_joules"))
    report.check("every figure finite", finite, "measured and predicted joules finite", finite)
    ratios = [r["predicted_over_measured"] for r in measured]
    gated = [r for r in measured if r["gated"]]
    low, high = RATIO_RANGE
    report.check("the prior's prediction against the measured energy, every GPU-bound row",
                 {f"{r['model']} {r['row']}": r["predicted_over_measured"] for r in gated},
                 f"predicted / measured within {low:g}-{high:g} where the GPU is in kernels "
                 f">= {BUSY_GATE:.0%} of the step", bool(gated) and all(
                     low <= r["predicted_over_measured"] <= high for r in gated))
    report.check("the prior against the measured energy, launch-bound rows",
                 {f"{r['model']} {r['row']}": (r["predicted_over_measured"],
                                               r["gpu_kernel_busy"])
                  for r in measured if not r["gated"]},
                 "reported, not gated: (predicted / measured, kernel busy share)", None)
    mape = float(np.mean([abs(x - 1) for x in ratios]) * 100) if ratios else math.nan
    report.check("the prior's error over the rows (MAPE, %)", mape, "reported, not gated", None)
    key = gpu_profile_key(report.data["figures"]["gpu"])
    if key is not None and measured:
        spec = GPU_SPECS[key]
        dtype_bytes = models.dtype_bytes(models.config_of(MODELS[0], ctx.backend.model_variant))
        peak = spec.peak_flops_fp32 if dtype_bytes >= 4 else spec.peak_flops_16bit
        fit = fit_powers(measured, peak, spec.mem_bandwidth)
        shipped = power_fit(spec)
        report.figure("fitted_powers", {
            "this_gpu": fit, "profile": key,
            "prior_fit_json": None if shipped is None else {
                "idle_watts": spec.static_watts, "run_watts": shipped.run_watts,
                "occupancy_watts": shipped.occupancy_watts, "flop_watts": shipped.flop_watts,
                "byte_watts": shipped.byte_watts, "source": shipped.source}})
