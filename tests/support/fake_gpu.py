"""A stand-in GPU under vLLM's real engine: the worker class is vLLM's own GPU `Worker` (so its
`execute_model` and `sample_tokens`, and the plugin's wrappers around them, run as on a GPU);
only what touches the device is replaced:

- `fake_cuda.FakeCudaEvent` replaces `torch.cuda.Event`, and the simulated stream
  `torch.cuda.current_stream()` (the seam the plugin's step clock uses): the stream runs
  launched work in order, an event completes when the work enqueued before it is done,
  `elapsed_time` is the simulated GPU time between two events.
- `FakeModelRunner` behaves as model runner V2 (FAKE_GPU_RUNNER=v2, the default):
  `execute_model` launches the forward pass and returns None; `sample_tokens` launches sampling,
  then a post-processing tail, and returns an `AsyncModelRunnerOutput` that holds its
  `ModelRunnerOutput` as `model_runner_output`, as V2's does, and whose `get_output()` waits, as
  the real one does, only until the sampled tokens are copied out (not for the tail). As the V1
  runner without async scheduling (FAKE_GPU_RUNNER=v1-sync), `sample_tokens` waits for the
  sampled tokens itself and returns a plain `ModelRunnerOutput`. A step without tokens returns
  vLLM's shared `EMPTY_MODEL_RUNNER_OUTPUT` from `execute_model`, as both do.
- `FakeGpuWorker(Worker)` builds no model and allocates nothing; it answers the engine's set-up
  calls (KV-cache spec, memory) for the configured model's layers.

Requests stop with EOS after a number of tokens their prompt decides (prompt length mod 5, plus
1), so the engine's async scheduling meets requests that finish while their next step is
already scheduled. Every step's GPU interval (start event, end event) is appended to the JSON
lines file named by FAKE_GPU_LOG, when set: every event's completion time in recording order
(the plugin records one when a step starts and one when it ends), each step's scheduled request
ids, and the requests that sampled their EOS in it; so a test can compare what the engine was
sent and what each response says with what the device did.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from support.fake_cuda import STREAM, install_fake_cuda_events, log

FORWARD_NS = 2_000_000  # per step
PER_TOKEN_NS = 20_000
SAMPLE_NS = 500_000
TAIL_NS = 300_000  # after the copy of the sampled tokens (postprocessing, a drafter)


def stop_after(prompt_len: int) -> int:
    """How many tokens a request with this prompt generates before its EOS (inclusive)."""
    return prompt_len % 5 + 1


def _batch(scheduler_output: Any) -> dict[str, list[int]]:
    """Each scheduled request's scheduler numbers, as the engine core takes them: [tokens
    computed before the step, tokens scheduled, outputs so far, prompt length (-1 for a
    request scheduled before: `read_log` fills it in)]. A new request's outputs so far are
    taken as 0 (one resumed from preemption would have more)."""
    scheduled = scheduler_output.num_scheduled_tokens
    cached = scheduler_output.scheduled_cached_reqs
    batch = {r: [start, scheduled[r], outs, -1] for r, start, outs in
             zip(cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens,
                 strict=True)}
    batch.update({n.req_id: [n.num_computed_tokens, scheduled[n.req_id], 0,
                             len(n.prompt_token_ids or ())]
                  for n in scheduler_output.scheduled_new_reqs})
    return batch


class FakeModelRunner:
    is_pooling_model = False

    def __init__(self, eos: int, mode: str = "v2") -> None:
        self.eos = eos
        self.mode = mode
        self.outputs: dict[str, int] = {}  # tokens generated so far, per request
        self.prompts: dict[str, int] = {}
        self.pending: Any = None
        self.steps = 0

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        for req_id in scheduler_output.finished_req_ids:
            self.outputs.pop(req_id, None)
            self.prompts.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.prompts[new.req_id] = len(new.prompt_token_ids or ())
            self.outputs.setdefault(new.req_id, 0)
        log({"step": list(scheduler_output.num_scheduled_tokens),
             "tokens": scheduler_output.total_num_scheduled_tokens,
             "resumed": sorted(scheduler_output.scheduled_cached_reqs.resumed_req_ids),
             "batch": _batch(scheduler_output)})
        if scheduler_output.total_num_scheduled_tokens == 0:
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

            self.pending = None
            return EMPTY_MODEL_RUNNER_OUTPUT  # as vLLM's runners return for a step of no work
        STREAM.launch(FORWARD_NS + PER_TOKEN_NS * scheduler_output.total_num_scheduled_tokens)
        self.pending = scheduler_output
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

        scheduler_output, self.pending = self.pending, None
        if scheduler_output is None:
            return None
        scheduled = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        computed.update({n.req_id: n.num_computed_tokens for n in
                         scheduler_output.scheduled_new_reqs})
        req_ids = list(scheduled)
        sampled: list[list[int]] = []
        eos = []
        for req_id in req_ids:
            prompt = self.prompts.get(req_id, 0)
            if computed.get(req_id, 0) + scheduled[req_id] < prompt:
                sampled.append([])  # a prefill chunk short of the prompt's end
                continue
            self.outputs[req_id] = self.outputs.get(req_id, 0) + 1
            if self.outputs[req_id] == stop_after(prompt):
                eos.append(req_id)
            sampled.append([self.eos if self.outputs[req_id] >= stop_after(prompt) else 7])
        log({"eos": eos})
        ready_ns = STREAM.launch(SAMPLE_NS)
        STREAM.launch(TAIL_NS)
        output = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=[])
        self.steps += 1
        if self.mode == "v1-sync":  # waits for the sampled tokens on the host (.tolist())
            wait = ready_ns - time.perf_counter_ns()
            if wait > 0:
                time.sleep(wait / 1e9)
            output.sampled_token_ids = sampled
            return output

        class FakeAsyncOutput(AsyncModelRunnerOutput):
            """As model runner V2's `AsyncOutput`: holds the output it hands over, and fills in
            its sampled tokens once they are copied out."""

            def __init__(self) -> None:
                self.model_runner_output = output

            def get_output(self) -> Any:
                wait = ready_ns - time.perf_counter_ns()  # the copy of the sampled tokens
                if wait > 0:
                    time.sleep(wait / 1e9)
                self.model_runner_output.sampled_token_ids = sampled
                return self.model_runner_output

            def get_kv_connector_output(self) -> Any:
                return None

        return FakeAsyncOutput()

    def get_model(self) -> Any:
        return torch.nn.Module()


def _base_worker() -> type:
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


class FakeGpuWorker(_base_worker()):  # type: ignore[misc]
    """vLLM's GPU `Worker`, with a stand-in device and model runner."""

    def __init__(self, vllm_config: Any, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = False,
                 **kwargs: Any) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.parallel_config = vllm_config.parallel_config
        self.local_rank, self.rank = local_rank, rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.device = torch.device("cuda", local_rank)  # a device object; CUDA is not touched
        self.profiler = None
        mode = os.environ.get("FAKE_GPU_RUNNER", "v2")
        self.use_v2_model_runner = mode == "v2"
        self._pp_send_work: list[Any] = []
        eos = vllm_config.model_config.hf_config.eos_token_id
        self.model_runner = FakeModelRunner(eos[0] if isinstance(eos, list) else int(eos), mode)
        install_fake_cuda_events()

    def init_device(self) -> None:
        from vllm.distributed.parallel_state import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )

        init_distributed_environment(world_size=1, rank=0,
                                     distributed_init_method=self.distributed_init_method,
                                     local_rank=0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass

    def determine_available_memory(self) -> int:
        return 64 << 20

    def get_kv_cache_spec(self) -> dict[str, Any]:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        hf = self.model_config.hf_text_config
        head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=self.cache_config.block_size, num_kv_heads=hf.num_key_value_heads,
            head_size=head, dtype=self.model_config.dtype)
            for i in range(hf.num_hidden_layers)}

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        pass

    def compile_or_warm_up_model(self) -> Any:
        from vllm.v1.worker.worker_base import CompilationTimes

        fields = CompilationTimes._fields
        return CompilationTimes(*([0.0] * len(fields)))

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def get_model(self) -> Any:
        return self.model_runner.get_model()


def read_log(path: str) -> list[dict]:
    """The steps the stand-in GPU ran, in order: {"start", "end" (event ns), "reqs" (engine
    request ids), "tokens", "eos" (the requests that sampled their EOS in it), "resumed" (those
    resumed from preemption), "batch" (request id -> [tokens computed before the step,
    scheduled, outputs so far, prompt length])}."""
    with open(path) as f:
        records = [json.loads(line) for line in f]
    steps: list[dict] = []
    events: list[int] = []
    prompts: dict[str, int] = {}  # the runner logs a prompt's length when it is new
    for record in records:
        if "event" in record:
            events.append(record["event"])
            if len(events) == 2 * len(steps) and steps:  # the open step's end
                steps[-1]["end"] = events[-1]
        elif "step" in record:
            for req_id, numbers in record["batch"].items():
                if numbers[3] < 0:
                    numbers[3] = prompts[req_id]
                prompts[req_id] = numbers[3]
            steps.append({"start": events[-1], "end": None, "reqs": record["step"],
                          "tokens": record["tokens"], "eos": [],
                          "resumed": record.get("resumed", []), "batch": record["batch"]})
        elif "eos" in record:
            steps[-1]["eos"] = record["eos"]
    return steps
