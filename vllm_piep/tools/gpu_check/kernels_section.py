"""Section 6: `kernels_trace` on a real trace. torch.profiler records a few decode steps of the
dense model with detail mode's step and module ranges around them; `python -m kernels_trace`
merges the trace; reported: the share of kernel time it places in a module of the model tree
and the kernels it could not place."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

from vllm_piep.tools.gpu_check import models
from vllm_piep.tools.gpu_check.context import Context
from vllm_piep.tools.hf_tree import module_ranges, step_range

SHARE_TARGET = 0.95
MODEL = "llama-3.1-8b"


def run(ctx: Context) -> None:
    from torch.profiler import ProfilerActivity, profile

    backend, report = ctx.backend, ctx.report
    scale = backend.scale
    lm = models.build(backend, MODEL)
    runner = lm.decoder(scale.profiled_batch, scale.decode_context, scale.decode_positions)
    for _ in range(2):
        runner.step()
    backend.sync()
    activities = [ProfilerActivity.CPU]
    if backend.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with module_ranges(lm.model) as nodes, profile(activities=activities) as prof:
        for i in range(scale.profiled_steps):
            with step_range(i):
                runner.step()
        backend.sync()
    lm.release()
    trace, merged = ctx.scratch / "trace.json", ctx.scratch / "merged.json"
    prof.export_chrome_trace(str(trace))
    done = subprocess.run([sys.executable, "-m", "kernels_trace", str(trace), "--rank", "0",
                           "--json", str(merged)], capture_output=True, text=True, timeout=300)
    report.figure("kernels_trace_output", (done.stdout + done.stderr).strip().splitlines()[-3:])
    if not report.check("python -m kernels_trace merges the trace", done.returncode,
                        "exit 0", done.returncode == 0):
        return
    data = json.loads(merged.read_text())
    coverage = data["kernel_coverage"].get("0")
    report.figure("trace_mb", trace.stat().st_size / 1e6)
    report.figure("coverage", coverage)
    per_step = Counter(m["step"] for m in data["modules"])
    expected = {i: len(nodes) for i in range(scale.profiled_steps)}
    report.check("every step's module ranges are in the merged spans", dict(per_step),
                 f"{len(nodes)} modules in each of {scale.profiled_steps} steps",
                 dict(per_step) == expected)
    want = "gpu" if backend.device == "cuda" else "cpu"
    report.check("the kernel table holds the device's kernels",
                 None if coverage is None else coverage["device"],
                 f"{want} work found", coverage is not None and want in coverage["device"])
    share = 0.0 if coverage is None else coverage["share_in_modules"]
    report.check("the share of kernel time placed in a module of the model tree", share,
                 f">= {SHARE_TARGET:.0%}", share >= SHARE_TARGET)
