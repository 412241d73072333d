"""Section 5: measured mode on the real counter. The engine core's accountant with the prior,
and its meter thread on the NVML meter the engine builds (`meters.factory`), are fed real model
steps of staggered requests (prefill, then decode) timed by the CUDA-event step clock, as the
engine core feeds them; each finished request's output is held until the meter speaks for its
last step. Checked: conservation against the counter, every record measured, no step settled
by the fit, and the longest hold against the bound measured mode states."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

from vllm_piep.config import PiepConfig
from vllm_piep.meters.common import Device, Meter, MeterReading
from vllm_piep.meters.factory import meter_factory
from vllm_piep.meters.gpus import instance_gpus
from vllm_piep.model.flops import StepBatch
from vllm_piep.predict.loader import load_predictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.measured import EngineMeter
from vllm_piep.runtime.record import WireRecord
from vllm_piep.runtime.worker.steptime import CUDA_TIMER, CudaStepClock
from vllm_piep.tools.gpu_check import models
from vllm_piep.tools.gpu_check.backend import Scale
from vllm_piep.tools.gpu_check.context import Context
from vllm_piep.tools.gpu_check.nvml_section import require_whole_gpu

CONSERVATION = 1e-9  # relative
MODEL = "llama-3.1-8b"


class RecordingMeter(Meter):
    """The engine's meter, every reading kept (the test of conservation needs the first and
    the last the engine split)."""

    def __init__(self, meter: Meter) -> None:
        self.inner = meter
        self.name, self.source = meter.name, meter.source
        self.readings: list[MeterReading] = []

    @classmethod
    def available(cls) -> bool:
        return True

    @property  # type: ignore[override]
    def resolution_s(self) -> float:
        return self.inner.resolution_s

    def devices(self) -> list[Device]:
        return list(self.inner.devices())

    def start(self) -> None:
        self.inner.start()

    def stop(self) -> None:
        self.inner.stop()

    def read(self) -> MeterReading:
        reading = self.inner.read()
        self.readings.append(reading)
        return reading


@dataclass
class Request:
    rid: str
    arrival: int
    prompt: int
    outputs: int
    generated: int = 0


def plan(scale: Scale) -> list[Request]:
    """Staggered requests: one arrives every `arrival_every` steps."""
    return [Request(f"req-{r}", r * scale.arrival_every,
                    scale.prompt_tokens[r % len(scale.prompt_tokens)],
                    scale.output_tokens[r % len(scale.output_tokens)])
            for r in range(scale.requests)]


def schedule(requests: list[Request], step: int) -> tuple[list[str], StepBatch, list[str]]:
    """This step's requests, their batch as the scheduler describes it, and those it
    finishes: a new request's prompt in one step (which samples its first token), a running
    one's next token."""
    ids, rows, done = [], [], []
    for r in requests:
        if r.arrival == step:
            rows.append((r.prompt, 0, 0, 1))
        elif r.arrival < step and r.generated < r.outputs:
            rows.append((0, 1, r.prompt + r.generated - 1, 1))
        else:
            continue
        ids.append(r.rid)
        r.generated += 1
        if r.generated == r.outputs:
            done.append(r.rid)
    return ids, StepBatch.from_rows(rows), done


class Outputs:
    """Finished requests' outputs as they leave the engine: their records, and how long each
    waited for the meter."""

    def __init__(self, acc: EngineAccountant) -> None:
        self.acc = acc
        self.finished_ns: dict[str, int] = {}
        self.records: dict[str, WireRecord] = {}
        self.held_s: dict[str, float] = {}

    def send(self, rids: list[str]) -> None:
        """The outputs go out (lock held: the engine loop's, or the meter thread's)."""
        acc, now = self.acc, time.perf_counter_ns()
        for rid in rids:
            self.records[rid] = WireRecord.from_wire(acc.header(counts=False),
                                                     acc.encode([rid]))
            acc.release(rid, aborted=False)
            self.held_s[rid] = (now - self.finished_ns[rid]) / 1e9


def run(ctx: Context) -> None:
    backend, report = ctx.backend, ctx.report
    scale = backend.scale
    with ctx.nvml() as nvml:
        gpu = instance_gpus(nvml, [0], {0: backend.identity(0)})[0]
        require_whole_gpu(nvml, gpu.handle)
    gpu_name = gpu.name
    lm = models.build(backend, MODEL)
    predictor = load_predictor(PiepConfig(), lm.shape, "cuda", gpu_name, lm.architecture)
    lm.packed(256, [255])  # the first forward's one-off work, before the meter runs
    backend.sync()

    factory, label = meter_factory("nvml", 1)
    recording: list[RecordingMeter] = []

    def make_meter() -> Meter:
        recording.append(RecordingMeter(factory()))
        return recording[-1]

    acc = EngineAccountant(lambda: predictor)
    outputs = Outputs(acc)
    # Held outputs the meter thread releases while the engine is idle go out from there.
    meter = EngineMeter(acc, make_meter, label, lambda: predictor.idle_watts,
                        put_outputs=lambda _client, outs: outputs.send(
                            [o.request_id for o in outs]))
    meter.start()
    deadline = time.monotonic() + 10.0
    while meter.meter is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if not report.check("measured mode opens the NVML meter", meter.meter is not None,
                        "open within 10 s (the log says why not)", meter.meter is not None):
        meter.stop()
        lm.release()
        return
    report.figure("meter", {"label": label, "period_s": meter.period_s,
                            "resolution_s": meter.meter.resolution_s, "hold_s": meter.hold_s})

    requests = plan(scale)
    clock = CudaStepClock()
    step_s: list[float] = []
    step = 0
    while any(r.generated < r.outputs for r in requests):
        ids, batch, done = schedule(requests, step)
        if ids:
            with acc.lock:
                acc.on_schedule(step, ids, batch)
            tokens = int(batch.tokens.sum())
            last = list(map(int, batch.tokens.cumsum() - 1))
            clock.begin()
            lm.packed(tokens, last)
            timed = clock.end()
            backend.sync()
            assert timed is not None
            ns = timed.ns()
            step_s.append(ns / 1e9)
            with acc.lock:
                acc.on_step_done(step, ns, CUDA_TIMER)
                for rid in done:
                    outputs.finished_ns[rid] = time.perf_counter_ns()
                    meter.hold(0, SimpleNamespace(request_id=rid))
                outputs.send([h.output.request_id for h in meter.settle_in_loop()])
        step += 1
    deadline = time.monotonic() + meter.hold_s + 2 * meter.period_s + 1.0
    while len(outputs.records) < len(requests) and time.monotonic() < deadline:
        time.sleep(meter.period_s / 2)
    meter.stop()
    with acc.lock:
        acc.settle()
    lm.release()
    check(ctx, acc, meter, recording[-1], outputs, len(requests), step_s)


def check(ctx: Context, acc: EngineAccountant, meter: EngineMeter, recording: RecordingMeter,
          outputs: Outputs, requests: int, step_s: list[float]) -> None:
    report = ctx.report
    counts = acc.counts()
    delta = recording.readings[-1].total - recording.readings[0].total
    report.figure("steps", {"count": len(step_s), "mean_ms": sum(step_s) / len(step_s) * 1e3,
                            "max_ms": max(step_s) * 1e3, "by_timer": counts.steps_by_timer})
    report.figure("energy", {"counter_delta_joules": delta, "steps_joules": acc.total_joules,
                             "idle_joules": counts.idle_joules,
                             "predicted_joules": counts.predicted_joules,
                             "warmup_joules": acc.warmup_joules,
                             "unsent_joules": acc.unsent_joules,
                             "after_finish_joules": acc.after_finish_joules,
                             "aborted_joules": acc.aborted_joules,
                             "measured_over_predicted": acc.total_joules / counts.predicted_joules
                             if counts.predicted_joules else None,
                             "readings": len(recording.readings)})
    report.check("every finished request's record went out", len(outputs.records),
                 f"{requests} records", len(outputs.records) == requests)
    total = acc.total_joules + counts.idle_joules
    report.check("steps + idle = the counter's delta", {"steps_plus_idle": total,
                                                        "counter_delta": delta},
                 f"equal within {CONSERVATION:g} relative",
                 delta > 0 and abs(total / delta - 1) <= CONSERVATION)
    billed = (sum(r.joules for r in outputs.records.values()) + acc.warmup_joules
              + acc.unsent_joules + acc.after_finish_joules + acc.aborted_joules)
    report.check("requests + warm-up + unsent = the steps' measured energy",
                 {"requests_and_rest": billed, "steps": acc.total_joules},
                 f"equal within {CONSERVATION:g} relative",
                 acc.total_joules > 0 and abs(billed / acc.total_joules - 1) <= CONSERVATION)
    wrong = {rid: (r.source, r.meter, r.complete) for rid, r in outputs.records.items()
             if r.source != "measured" or r.meter != meter.label or not r.complete}
    report.check("every record is measured, by the meter named", wrong,
                 f"source measured, meter {meter.label}, complete", not wrong and
                 bool(outputs.records))
    report.check("no step settled by the fit", {"fallback_steps": counts.fallback_steps,
                                                "fitted_joules": counts.fitted_joules},
                 "none", counts.fallback_steps == 0 and counts.fitted_joules == 0)
    longest = max(outputs.held_s.values(), default=float("nan"))
    typical = recording.resolution_s + meter.period_s + max(step_s)
    bound = meter.hold_s + max(step_s)
    report.figure("hold", {"longest_s": longest, "median_s": sorted(outputs.held_s.values())[
                               len(outputs.held_s) // 2] if outputs.held_s else None,
                           "counter_period_plus_read_period_plus_longest_step_s": typical,
                           "hold_limit_plus_longest_step_s": bound})
    report.check("the longest hold of a finished request", longest,
                 f"<= {bound * 1e3:.0f} ms: the hold limit ({meter.hold_s * 1e3:.0f} ms of "
                 "engine time) plus the longest step", longest <= bound)
