"""Span records: what one rank did in each engine step, written to one append-only JSONL file
per rank and read back into tables. No vLLM imports.

Schema `piep.spans/1` (one JSON object per line, `kind` names the record):

- `header` (first line): rank layout (`rank`, `world_size`, `tp_rank`/`tp_size`, `pp_rank`/
  `pp_size`, `dp_rank`/`dp_size`), `host`, `boot_id`, `pid`, `clock` (the clock of every
  timestamp in the file, in ns: CLOCK_MONOTONIC for the plugin's files, CLOCK_REALTIME for files
  made from profiler traces by kernels_trace), `realtime_offset_ns` (CLOCK_REALTIME minus
  CLOCK_MONOTONIC when the file was opened, to line a plugin file up with a trace),
  `clock_offset_ns` (this rank's clock minus rank 0's; 0 when both share a host) and
  `clock_offset_error_ns`, `instance` (shared by the ranks of one vLLM instance), `model`,
  `architecture`, `dtype`, `shape` (the `flops.ModelShape` fields, from which each module's
  FLOPs and bytes in a step follow), `mode` (`step` or `detail`), `timer` (`perf_counter_ns`,
  `cuda_event`, or the trace format `kineto`/`nsys`) and `tree` (the rank's `ModelTree`,
  detail mode only).
- `step`: `step` (the worker's step index, equal on every rank of an instance), `start_ns`,
  `end_ns`, `prefill_tokens`, `decode_tokens`, `num_reqs`, and the sums that module work depends
  on (`flops.StepTotals`): `context_tokens` (cached tokens before the step, over requests),
  `attended_pairs` (causal query-key pairs), `sampled_rows` (rows sent to the LM head).
- `resource`: `t_ns` and the rank's resource features at that time (`vllm_piep.meters.resources`:
  `cpu_util`, `cpu_mem_util`, `cpu_clock_mhz`, `process_rss_bytes`, and on GPUs `gpu_util`,
  `gpu_mem_util`, `gpu_clock_mhz`, `gpu_mem_clock_mhz`, `gpu_mem_bytes`), written when
  `resource_interval_s` is set.
- `module`: `step`, `node` (a `ModelTree` node id), `type`, `layer` (or null), `start_ns`,
  `end_ns`, `prefill_tokens`, `decode_tokens`.
- `collective`: `step`, `op`, `group` (vLLM's group name, e.g. `tp:0`), `world_size`,
  `rank_in_group`, `peer` (the other rank in the group for send/recv, else null), `seq` (the
  call's index among this rank's calls in that group, or with that peer for send/recv: equal on
  every participant of one collective), `bytes`, `dtype`, `arrival_ns` (entry), `completion_ns`
  (return), `node` (the module node the call ran inside, or null) and `async` (true when the call
  only posts the transfer, so that completion is the posting time).
- `sample` (repeated sampling, `runtime/worker/replay.py`; detail mode with `sampling`): one
  meter window of `calls` back-to-back runs of a module (`target` `module`, `node`) or of a
  collective (`target` `collective`: `op`, `group`, `seq` name the recorded call it repeats,
  `node` the module it ran inside), `window` (its index in the step), `start_ns`, `end_ns`.
  A sampled step's `step` record has `replay_ns`: the time the replays added to it.
  Every `step` record has `worker_ns`: the step time the worker sends the engine, which the
  serve path's predictor reads (the worker's own calls, without the gap between them).

A file cut short by a crash is readable up to its last complete line.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_piep.clock import now_ns

SCHEMA = "piep.spans/1"



class SpanHeader(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["header"] = "header"
    schema_: str = Field(SCHEMA, alias="schema")
    rank: int
    world_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    host: str
    boot_id: str = ""
    pid: int
    clock: str = "CLOCK_MONOTONIC"
    realtime_offset_ns: int = Field(default_factory=lambda: time.time_ns() - now_ns())
    clock_offset_ns: int = 0
    clock_offset_error_ns: int = 0
    instance: str = ""
    model: str = ""
    architecture: str = ""
    dtype: str = ""
    shape: dict[str, Any] | None = None
    mode: Literal["step", "detail"] = "step"
    timer: Literal["perf_counter_ns", "cuda_event", "kineto", "nsys"] = "perf_counter_ns"
    tree: dict[str, Any] | None = None


class StepSpan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["step"] = "step"
    step: int
    start_ns: int
    end_ns: int
    prefill_tokens: int
    decode_tokens: int
    num_reqs: int
    context_tokens: int = 0
    attended_pairs: int = 0
    sampled_rows: int = 0
    replay_ns: int = 0  # time spent in repeated sampling inside this step (0: not sampled)
    worker_ns: int = 0  # the step time sent to the engine (the serve path's `step_seconds`)


class ModuleSpan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["module"] = "module"
    step: int
    node: str
    type: str
    layer: int | None
    start_ns: int
    end_ns: int
    prefill_tokens: int
    decode_tokens: int


class CollectiveSpan(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: Literal["collective"] = "collective"
    step: int
    op: str
    group: str
    world_size: int
    rank_in_group: int
    peer: int | None
    seq: int
    bytes: int
    dtype: str
    arrival_ns: int
    completion_ns: int
    node: str | None
    async_: bool = Field(False, alias="async")


class ResourceSample(BaseModel):
    """One sample of the rank's resource features (`meters/resources.py`): feature columns
    vary with the hardware (CPU only, or with GPU features)."""

    model_config = ConfigDict(extra="allow")

    kind: Literal["resource"] = "resource"
    t_ns: int


class SampleSpan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["sample"] = "sample"
    step: int
    target: Literal["module", "collective"]
    node: str | None
    op: str | None = None
    group: str | None = None
    seq: int | None = None
    calls: int = Field(ge=1)
    window: int = Field(ge=0)
    start_ns: int
    end_ns: int


RECORD_TYPES: dict[str, type[BaseModel]] = {
    "step": StepSpan, "module": ModuleSpan, "collective": CollectiveSpan,
    "resource": ResourceSample, "sample": SampleSpan,
}
P2P_OPS = frozenset({"send", "recv"})


def header_json(header: SpanHeader) -> str:
    return header.model_dump_json(by_alias=True)


def read_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def estimate_clock_offset(samples: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """Cristian's estimate of (remote clock - local clock) from ping-pong samples
    (local send, remote reply time, local receive): the sample with the shortest round trip
    wins; its error bound is half that round trip."""
    if not samples:
        raise ValueError("no clock samples")
    t0, remote, t1 = min(samples, key=lambda s: s[2] - s[0])
    if t1 < t0:
        raise ValueError("clock sample with negative round trip")
    return remote - (t0 + t1) // 2, (t1 - t0 + 1) // 2


# Names of the torch.profiler ranges that detail mode opens (`record_function`) while a profiler
# is on, so that a Kineto or Nsight trace can be cut into the same spans (see kernels_trace).
STEP_RANGE = "piep.step"
MODULE_RANGE = "piep.module"


def step_range_name(step: int) -> str:
    return f"{STEP_RANGE}/{step}"


def module_range_name(node_type: str, node: str) -> str:
    return f"{MODULE_RANGE}/{node_type}/{node}"


def parse_range_name(name: str) -> tuple[str, dict[str, Any]] | None:
    """('step', {'step': n}) or ('module', {'type': t, 'node': id, 'layer': i|None}) for a
    detail-mode range name, None for anything else."""
    if name.startswith(STEP_RANGE + "/"):
        tail = name[len(STEP_RANGE) + 1:]
        return ("step", {"step": int(tail)}) if tail.isdigit() else None
    if name.startswith(MODULE_RANGE + "/"):
        node_type, _, node = name[len(MODULE_RANGE) + 1:].partition("/")
        if not node:
            return None
        return "module", {"type": node_type, "node": node, "layer": layer_of(node)}
    return None


def layer_of(node: str) -> int | None:
    """The layer index in a node id such as `layers.3.mlp`, else None."""
    parts = node.split(".")
    if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1])
    return None
