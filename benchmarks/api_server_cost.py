"""The plugin's own CPU per token in the API server, in-process: its two per-output hooks timed
against vLLM's calls bare.

- Taking the rows off a batch of engine outputs (`outputs._wrap_process_outputs`: the header
  decoded and counted on /metrics, each output's row handed to the ledger), for a batch of
  `--batch` outputs, one per request, the first carrying the header and rows block as the
  engine core sends them.
- A streamed response's tap and generator layer (`endpoints._wrap_stream_generator`) on a
  stream of `--chunks` chunks.

Medians over `--repeats` alternated bare/wrapped calls, in µs per output (per chunk).

    .venv/bin/python benchmarks/api_server_cost.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from array import array
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_overhead import finish_run, header, json_option  # noqa: E402

from vllm_piep.runtime.api_server import endpoints, outputs  # noqa: E402
from vllm_piep.runtime.api_server.response_ids import collecting  # noqa: E402
from vllm_piep.runtime.record import (  # noqa: E402
    HEADER_KEY,
    ROW_FIELDS,
    ROWS_KEY,
    StepHeader,
    encode_rows,
)


def rows_per_output_us(batch: int, repeats: int, rows: bool = True) -> float:
    """µs per output that taking the rows off a batch adds to `process_outputs`: a batch
    whose every output carries its row (a dense engine), or with `rows=False` one with no row
    (most batches of a sparse engine: rows only on finishing outputs)."""
    step_header = StepHeader(source="prior", bundle_id="prior/cpu", engine_id="0",
                             step_joules=0.1, errors=0, predictor_ok=True,
                             carries_counts=True).encode()
    block = encode_rows(array("d", np.random.default_rng(0).random(batch * len(ROW_FIELDS))))
    processor = SimpleNamespace(request_states={
        f"r{i}": SimpleNamespace(parent_req=None, request_id=f"r{i}") for i in range(batch)})

    def engine_batch() -> list[Any]:
        outs = [SimpleNamespace(request_id=f"r{i}", kv_transfer_params=None)
                for i in range(batch)]
        if rows:
            outs[0].kv_transfer_params = {HEADER_KEY: step_header, ROWS_KEY: block}
        return outs

    def bare(self: Any, engine_core_outputs: list[Any]) -> None:
        return None

    wrapped = outputs._wrap_process_outputs(bare)
    added = []
    for _ in range(repeats):
        a, b = engine_batch(), engine_batch()
        t0 = time.perf_counter_ns()
        bare(processor, a)
        t1 = time.perf_counter_ns()
        wrapped(processor, b)
        t2 = time.perf_counter_ns()
        added.append((t2 - t1) - (t1 - t0))
    return statistics.median(added[repeats // 10:]) / 1e3 / batch


def stream_per_chunk_us(chunks: int, repeats: int) -> float:
    """µs per chunk that the stream wrapper (its generator layer and the final-usage check)
    adds to a streamed response."""
    async def results() -> AsyncIterator[Any]:
        for _ in range(chunks):
            yield None

    async def original(request: Any, result_generator: AsyncIterator[Any],
                       request_id: str) -> AsyncIterator[str]:
        async for _ in result_generator:
            yield 'data: {"id":"cmpl-1","object":"text_completion","created":1,' \
                  '"model":"model","choices":[{"index":0,"text":" x","logprobs":null,' \
                  '"finish_reason":null,"stop_reason":null}]}\n\n'

    wrapped = endpoints._wrap_stream_generator(original)

    async def drain(stream: AsyncIterator[str]) -> float:
        t0 = time.perf_counter_ns()
        async for _ in stream:
            pass
        return time.perf_counter_ns() - t0

    async def run() -> float:
        added = []
        for _ in range(repeats):
            bare_ns = await drain(original(None, results(), "x"))
            added.append(await drain(wrapped(None, results(), "x")) - bare_ns)
        return statistics.median(added) / 1e3 / chunks

    return asyncio.run(run())


def add_request_us(repeats: int) -> float:
    """µs per request that noting its owner adds to `OutputProcessor.add_request`, inside a
    response's scope."""
    def bare(self: Any, request: Any, prompt: Any, parent_req: Any = None,
             request_index: int = 0, queue: Any = None) -> None:
        return None

    wrapped = outputs._wrap_add_request(bare)
    request = SimpleNamespace(request_id="r1")
    added = []
    with collecting():
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            bare(None, request, None, None, 0, None)
            t1 = time.perf_counter_ns()
            wrapped(None, request, None, None, 0, None)
            t2 = time.perf_counter_ns()
            added.append((t2 - t1) - (t1 - t0))
    return statistics.median(added) / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=26,
                        help="outputs per engine batch (default 26: tokens per step at 32 "
                             "streams on the tiny model)")
    parser.add_argument("--chunks", type=int, default=20000,
                        help="chunks per timed stream (default 20000)")
    parser.add_argument("--repeats", type=int, default=3000,
                        help="alternated batches (streams: a hundredth of it; default 3000)")
    json_option(parser, "api_server_cost.json")
    args = parser.parse_args()
    info = header("API server: the plugin's per-output hooks, in-process")
    dense = rows_per_output_us(args.batch, args.repeats)
    sparse = rows_per_output_us(args.batch, args.repeats, rows=False)
    stream = stream_per_chunk_us(args.chunks, max(3, args.repeats // 100))
    add = add_request_us(args.repeats)
    print(f"rows taken off a batch of {args.batch} outputs, each with its row: {dense:.2f} us "
          "per output")
    print(f"a batch of {args.batch} outputs without rows (a sparse engine's usual batch): "
          f"{sparse:.3f} us per output")
    print(f"a stream's generator layer and final-usage check: {stream:.2f} us per chunk")
    print(f"a request's owner noted when it is added: {add:.2f} us per request")
    finish_run(info, args, {"rows_us_per_output": dense, "no_rows_us_per_output": sparse,
                            "stream_us_per_chunk": stream, "add_request_us": add})
    return 0


if __name__ == "__main__":
    sys.exit(main())
