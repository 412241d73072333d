"""A detail-mode server run for the parallel tests: start, serve a mixed workload, stop (which
flushes every rank's span file), and read the spans back."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_piep.spans.reader import SpanSet, span_files
from vllm_piep.tools.server import ServerOptions, VllmServer

PROMPTS = ["def hello(x):", "import os\nimport sys\n\nclass Reader(object):\n    def read",
           "for i in range(10):", "x = [1, 2, 3]\ny = {'a': x}\nprint(y)\n" * 3]


@dataclass
class DetailRun:
    spans: SpanSet
    config: dict[str, Any]
    responses: list[dict[str, Any]]
    spans_dir: Path
    log: Path
    traces: list[Path]  # torch.profiler traces of the profiled request (profile=True)
    profiled: dict[str, Any] | None  # that request's response


def detail_run(model: Path, work: Path, extra_args: list[str], extra_env: dict[str, str],
               max_tokens: int = 6, profile: bool = False) -> DetailRun:
    """`profile`: also run vLLM's own torch profiler around one last request, so that its
    per-rank traces can be read back with kernels_trace."""
    spans_dir = work / "spans"
    trace_dir = work / "traces"
    config = {"piep": {"mode": "detail", "spans_dir": str(spans_dir)}}
    args = ["--additional-config", json.dumps(config), *extra_args]
    if profile:
        args += ["--profiler-config", json.dumps({
            "profiler": "torch", "torch_profiler_dir": str(trace_dir.resolve()),
            "torch_profiler_use_gzip": False, "torch_profiler_with_stack": False,
            "torch_profiler_record_shapes": True})]
    options = ServerOptions(model=str(model), extra_env=extra_env, extra_args=args)
    server = VllmServer(options, log_path=work / "server.log")
    server.start()
    try:
        def one(prompt: str) -> dict[str, Any]:
            return server.post("/v1/completions", {"model": "model", "prompt": prompt,
                                                   "max_tokens": max_tokens, "temperature": 0})

        responses = [one(PROMPTS[0])]  # alone: a clean one-request step sequence
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # together: batched steps
            responses += list(pool.map(one, PROMPTS))
        profiled = None
        if profile:
            server.post("/start_profile", {}, timeout=300)
            profiled = one(PROMPTS[1])
            server.post("/stop_profile", {}, timeout=600)
    finally:
        server.stop()
    files = span_files(spans_dir)
    traces = sorted(trace_dir.rglob("*.json")) if profile else []
    return DetailRun(SpanSet.read(files), json.loads((model / "config.json").read_text()),
                     responses, spans_dir, work / "server.log", traces, profiled)
