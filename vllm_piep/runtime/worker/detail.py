"""Span recording in the workers: the step recorder, module hooks (detail mode) and the
group-coordinator wrappers (detail mode).

- `Worker.load_model` (wrapped): when `spans_dir` is set, opens this rank's span file and a
  `StepRecorder`; in detail mode also builds the `ModelTree` from the loaded model, puts forward
  hooks on the tree's modules, and installs the patches below. Detail mode refuses compiled or
  CUDA-graph execution, where forward hooks and Python wrappers never run.
- `GroupCoordinator._all_reduce_out_place`, `_all_gather_out_place`, `all_gatherv`,
  `_reduce_scatter_out_place`, `reduce_scatterv`, `gather`, `broadcast`, `broadcast_tensor_dict`,
  `send_tensor_dict`, `isend_tensor_dict`, `recv_tensor_dict`, `irecv_tensor_dict`, and the
  expert-parallel `dispatch` and `combine`: one collective span per outermost call (the custom
  ops of vLLM's `all_reduce` etc. call these).
- `CPUWorker.compile_or_warm_up_model`: vLLM 0.32 skips the CPU warm-up in eager mode, and with
  it the buffer a later pipeline stage receives into (`assert self.intermediate_tensors is not
  None` on every request); this allocates it, as the warm-up would have.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_piep.config import ConfigError, PiepConfig
from vllm_piep.model.tree import ModelTree, ParallelLayout
from vllm_piep.once import logger
from vllm_piep.runtime.patching import Patch, install_all
from vllm_piep.runtime.vllm_config import model_shape
from vllm_piep.runtime.worker.batch import StepCounter
from vllm_piep.runtime.worker.recorder import CudaEventTimer, HostTimer, StepRecorder
from vllm_piep.runtime.worker.replay import ReplaySampler, clone_inputs
from vllm_piep.runtime.worker.step import RECORDER_ATTR
from vllm_piep.spans.records import SpanHeader, estimate_clock_offset, read_boot_id
from vllm_piep.spans.writer import SpanWriter

# The recorder of this process, for the collective wrappers (a worker process has one worker).
active: StepRecorder | None = None


# ------------------------------------------------------------------ worker setup
def require_eager(vllm_config: Any) -> None:
    from vllm.config import CompilationMode, CUDAGraphMode

    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "mode", None)
    graphs = getattr(compilation, "cudagraph_mode", None)
    compiled = mode not in (None, CompilationMode.NONE)
    captured = graphs not in (None, CUDAGraphMode.NONE)
    if compiled or captured or not vllm_config.model_config.enforce_eager:
        raise ConfigError(
            "vllm_piep detail mode records module spans with forward hooks, which never run "
            f"inside torch.compile or CUDA-graph replay (compilation mode {mode!s}, CUDA graphs "
            f"{graphs!s}). Start vLLM with --enforce-eager, or use mode `serve`.")


def _layout(vllm_config: Any) -> ParallelLayout:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    parallel = vllm_config.parallel_config
    return ParallelLayout(
        tp_size=parallel.tensor_parallel_size, pp_size=parallel.pipeline_parallel_size,
        dp_size=parallel.data_parallel_size, tp_rank=get_tp_group().rank_in_group,
        pp_rank=get_pp_group().rank_in_group, dp_rank=parallel.data_parallel_rank)


def _clock_offset() -> tuple[int, int]:
    """(this rank's clock - rank 0's, error bound) in ns. Ranks on rank 0's host (same boot id)
    share CLOCK_MONOTONIC: exactly 0. Otherwise a ping-pong estimate over the world group."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    world = get_world_group()
    if world.world_size == 1:
        return 0, 0
    me = (socket.gethostname(), read_boot_id())
    everyone: list[Any] = [None] * world.world_size
    dist.all_gather_object(everyone, me, group=world.cpu_group)
    if all(other == everyone[0] for other in everyone):
        return 0, 0
    samples = []
    for _ in range(16):
        dist.barrier(group=world.cpu_group)
        t0 = time.perf_counter_ns()
        stamps: list[Any] = [None] * world.world_size
        dist.all_gather_object(stamps, time.perf_counter_ns(), group=world.cpu_group)
        samples.append((t0, stamps[0], time.perf_counter_ns()))
    offset_to_rank0, error = estimate_clock_offset(samples)
    return -offset_to_rank0, error


def setup_worker(worker: Any) -> StepRecorder | None:
    """Called after the model is loaded. Returns the recorder, or None without `spans_dir`."""

    global active
    vllm_config = worker.vllm_config
    config = PiepConfig.from_sources(vllm_config.additional_config)
    if config.spans_dir is None:
        return None
    detail = config.mode == "detail"
    if detail:
        require_eager(vllm_config)  # the same verdict on every rank
    # First, while every rank is sure to get here: it is a collective over the world group.
    offset, error = _clock_offset()
    layout = _layout(vllm_config)
    model = worker.model_runner.get_model()
    architecture = (vllm_config.model_config.architectures or [""])[0]
    tree = ModelTree.from_module(model, layout, architecture) if detail else None
    on_gpu = str(getattr(worker, "device", "cpu")).startswith("cuda")
    timer = CudaEventTimer() if on_gpu else HostTimer()
    instance = vllm_config.instance_id or f"pid{os.getppid()}"
    rank = int(getattr(worker, "rank", 0))
    header = SpanHeader(
        rank=rank, world_size=vllm_config.parallel_config.world_size_across_dp,
        tp_rank=layout.tp_rank, tp_size=layout.tp_size, pp_rank=layout.pp_rank,
        pp_size=layout.pp_size, dp_rank=layout.dp_rank, dp_size=layout.dp_size,
        host=socket.gethostname(), boot_id=read_boot_id(), pid=os.getpid(),
        clock_offset_ns=offset, clock_offset_error_ns=error, instance=instance,
        model=str(vllm_config.model_config.model), architecture=architecture,
        dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        shape=dataclasses.asdict(model_shape(vllm_config)),
        mode="detail" if detail else "step", timer=timer.name,
        tree=tree.to_dict() if tree else None)
    path = Path(config.spans_dir) / f"{instance}-dp{layout.dp_rank}-rank{rank:03d}.spans.jsonl"
    recorder = StepRecorder(SpanWriter(path, header), tree, timer, StepCounter())
    if tree is not None:
        if config.sampling is not None:
            recorder.sampler = _sampler(config, on_gpu, model_shape(vllm_config).layers)
        _attach_module_hooks(model, recorder)
        install_all(collective_patches())
    if config.resource_interval_s > 0:
        recorder.resources = _start_resources(recorder.writer, config.resource_interval_s, on_gpu,
                                              worker)
    worker.__dict__[RECORDER_ATTR] = recorder
    active = recorder
    logger.info("vllm_piep: rank %d writes %s spans to %s", rank, config.mode, path)
    return recorder


def _start_resources(writer: SpanWriter, interval_s: float, on_gpu: bool, worker: Any) -> Any:
    from vllm_piep.meters.resources import ResourceSampler

    nvml, gpus = None, ()
    if on_gpu:
        try:
            import pynvml

            from vllm_piep.meters.gpus import CudaIdentity, instance_gpus

            pynvml.nvmlInit()
            # The worker's CUDA device is found in NVML by its UUID or PCI address: the CUDA
            # ordinal is not an NVML index.
            ordinal = int(getattr(worker.device, "index", 0) or 0)
            found = instance_gpus(pynvml, [ordinal],
                                  identities={ordinal: CudaIdentity.of_torch(ordinal)})
            nvml, gpus = pynvml, tuple(g.index for g in found)
        except Exception as exc:  # features without the GPU part, said once
            logger.warning("vllm_piep: no GPU resource features (NVML: %s)", exc)
    sampler = ResourceSampler(interval_s, nvml=nvml, gpu_indices=gpus,
                              on_sample=lambda t, v: writer.put({"kind": "resource",
                                                                 "t_ns": t, **v}))
    sampler.start()
    return sampler


def _sampler(config: PiepConfig, on_gpu: bool, n_layers: int) -> ReplaySampler:
    import torch

    opts = config.sampling
    assert opts is not None
    return ReplaySampler(windows=opts.windows, min_window_s=opts.min_window_s, every=opts.every,
                         max_calls=opts.max_calls, layers=opts.layers, n_layers=n_layers,
                         agree=_tp_max,
                         sync=torch.cuda.synchronize if on_gpu else (lambda: None))


def _tp_max(calls: int) -> int:
    """The largest of the tensor-parallel group's call counts: every rank replays as often."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return calls
    value = torch.tensor([calls], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group.cpu_group)
    return int(value.item())


def _attach_module_hooks(model: Any, recorder: StepRecorder) -> None:
    for index, node in enumerate(recorder.nodes):
        assert node.modules is not None
        first, last = (model.get_submodule(name) for name in node.modules)
        first.register_forward_pre_hook(lambda _m, _a, i=index: recorder.enter(i))
        last.register_forward_hook(lambda _m, _a, _o, i=index: recorder.exit(i))
        if recorder.sampler is not None and first is last:
            # Registered after the span hook: the module's span ends before its replays.
            last.register_forward_hook(_replay_hook(recorder, index), with_kwargs=True)


def _replay_hook(recorder: StepRecorder, index: int) -> Callable[..., None]:
    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _output: Any) -> None:
        sampler = recorder.sampling(index)
        if sampler is None:
            return
        call_args, call_kwargs = clone_inputs(args), clone_inputs(kwargs)
        windows = sampler.replay(lambda: module(*call_args, **call_kwargs))
        recorder.add_replay(windows, index, "module")

    return hook


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            setup_worker(self)
        except Exception as exc:
            config = PiepConfig.from_sources(self.vllm_config.additional_config)
            if config.mode == "detail":
                raise  # the user asked for spans: stop with the reason rather than serve without
            logger.warning("vllm_piep: step spans are off on this rank: %s: %s",
                           type(exc).__name__, exc, exc_info=exc)
        return result

    return load_model


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = self.__dict__.get(RECORDER_ATTR)
        if recorder is not None:
            recorder.end_step()
            if recorder.resources is not None:
                recorder.resources.stop()
            if recorder.writer is not None:
                recorder.writer.close()
        return original(self, *args, **kwargs)

    return shutdown


def span_patches() -> list[Patch]:
    from vllm.v1.worker.gpu_worker import Worker

    return [
        Patch(Worker, "load_model", _wrap_load_model,
              why="opens the span file and, in detail mode, hooks the loaded model",
              how="after the original: with `spans_dir` set, opens the rank's span file; in "
                  "detail mode builds the model tree, adds forward hooks, wraps collectives",
              until="vLLM exposes per-module and per-collective timing hooks"),
        Patch(Worker, "shutdown", _wrap_shutdown, why="flushes the span file on shutdown",
              how="before the original: ends the open step span and closes the writer",
              until="the span recording above can go"),
    ]


def cpu_eager_pipeline_patches() -> list[Patch]:
    """Only on the CPU platform: importing `vllm.v1.worker.cpu_worker` replaces
    `torch.cuda.Event`, `torch.cuda.Stream`, `torch.accelerator.get_memory_info`,
    `torch.accelerator.synchronize` and `Tensor.pin_memory` for the whole process
    (`vllm.v1.worker.cpu.shm`), which would break a GPU engine core that runs its worker
    in-process."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker
    except ImportError:  # a build without the CPU worker
        return []
    return [Patch(CPUWorker, "compile_or_warm_up_model", _wrap_warm_up,
                  why="lets eager pipeline-parallel stages receive (vLLM 0.32 CPU skips the "
                      "warm-up that allocates their receive buffer)",
                  how="after the original, allocates `intermediate_tensors` on a later "
                      "pipeline stage when the warm-up did not",
                  until="vLLM's CPU worker warms up (or allocates the buffer) in eager mode")]


def _wrap_warm_up(original: Callable[..., Any]) -> Callable[..., Any]:
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        from vllm.distributed.parallel_state import get_pp_group

        runner = self.model_runner
        if (getattr(runner, "intermediate_tensors", 0) is None
                and not get_pp_group().is_first_rank
                and hasattr(runner.model, "make_empty_intermediate_tensors")):
            runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
                batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype,
                device=runner.device)
        return result

    return compile_or_warm_up_model


# ------------------------------------------------------------------ collectives
def _tensor_bytes(value: Any) -> tuple[int, str]:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size(), str(value.dtype).removeprefix("torch.")
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        tensors = [v for v in value if isinstance(v, torch.Tensor)]
        dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors}
        return (sum(t.numel() * t.element_size() for t in tensors),
                dtypes.pop() if len(dtypes) == 1 else "mixed" if dtypes else "")
    return 0, ""


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


Payload = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], tuple[int, str]]


def _input_payload(_self: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   _result: Any) -> tuple[int, str]:
    return _tensor_bytes(_arg(args, kwargs, 0, "input_"))


def _hidden_payload(_self: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    _result: Any) -> tuple[int, str]:
    return _tensor_bytes(_arg(args, kwargs, 0, "hidden_states"))


def _dict_arg_payload(_self: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      _result: Any) -> tuple[int, str]:
    return _tensor_bytes(_arg(args, kwargs, 0, "tensor_dict"))


def _result_payload(_self: Any, _args: tuple[Any, ...], _kwargs: dict[str, Any],
                    result: Any) -> tuple[int, str]:
    if isinstance(result, tuple):  # irecv_tensor_dict: (dict, handles, postprocess)
        result = result[0]
    return _tensor_bytes(result)


def _peer(self: Any, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    if op == "send":
        dst = _arg(args, kwargs, 1, "dst")
        return (self.rank_in_group + 1) % self.world_size if dst is None else int(dst)
    if op == "recv":
        src = _arg(args, kwargs, 0, "src")
        return (self.rank_in_group - 1) % self.world_size if src is None else int(src)
    return None


def _collective(op: str, payload: Payload, posts_only: bool = False
                ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            recorder = active
            if recorder is None or self.world_size == 1:
                return original(self, *args, **kwargs)
            arrival = recorder.collective_begin()
            if arrival is None:
                return original(self, *args, **kwargs)
            try:
                result = original(self, *args, **kwargs)
            except BaseException:
                recorder.collective_abort()
                raise
            nbytes, dtype = payload(self, args, kwargs, result)
            is_async = posts_only and not getattr(self, "use_cpu_custom_send_recv", False)
            seq = recorder.collective_end(arrival, op, self.unique_name, self.world_size,
                                          self.rank_in_group, _peer(self, op, args, kwargs),
                                          nbytes, dtype, is_async)
            inside = recorder.enclosing()
            sampler = recorder.sampling(inside) if inside is not None else None
            # Tensor-parallel groups only: `agree` runs over the TP group, and a data- or
            # expert-parallel collective would need its other ranks to sample the same step.
            if (sampler is not None and op in REPLAYED_OPS
                    and str(self.unique_name).startswith("tp")):
                call_args, call_kwargs = clone_inputs(args), clone_inputs(kwargs)
                windows = sampler.replay(lambda: original(self, *call_args, **call_kwargs))
                recorder.add_replay(windows, inside, "collective", op, self.unique_name, seq)
            return result

        return wrapper

    return make


# Collectives that repeated sampling replays: every rank of the group takes part in the same
# call, so all replay it together. Point-to-point sends are not: a replayed send needs its
# receiver to replay too, at a different place in the other stage's step.
REPLAYED_OPS = frozenset({"all_reduce", "all_gather", "gather", "reduce_scatter"})

_COLLECTIVES: list[tuple[str, str, Payload, bool]] = [
    ("_all_reduce_out_place", "all_reduce", _input_payload, False),
    ("_all_gather_out_place", "all_gather", _input_payload, False),
    ("all_gatherv", "all_gather", _input_payload, False),
    ("_reduce_scatter_out_place", "reduce_scatter", _input_payload, False),
    ("reduce_scatterv", "reduce_scatter", _input_payload, False),
    ("gather", "gather", _input_payload, False),
    ("broadcast", "broadcast", _input_payload, False),
    ("broadcast_tensor_dict", "broadcast", _result_payload, False),
    ("send_tensor_dict", "send", _dict_arg_payload, False),
    ("isend_tensor_dict", "send", _dict_arg_payload, True),
    ("recv_tensor_dict", "recv", _result_payload, False),
    ("irecv_tensor_dict", "recv", _result_payload, True),
    # Expert parallelism through vLLM's all2all managers (the default all-gather /
    # reduce-scatter backend and the naive one); DeepEP and pplx kernels bypass these.
    ("dispatch", "dispatch", _hidden_payload, False),
    ("combine", "combine", _hidden_payload, False),
]
_collective_patches: list[Patch] = []


def collective_patches() -> list[Patch]:
    from vllm.distributed.parallel_state import GroupCoordinator

    if not _collective_patches:
        _collective_patches.extend(
            Patch(GroupCoordinator, name, _collective(op, payload, posts_only),
                  why=f"records {op} spans in detail mode",
                  how="around the original: arrival and completion marks, bytes and peer; "
                      "replays tensor-parallel collectives on sampled steps",
                  until="vLLM exposes per-collective timing hooks")
            for name, op, payload, posts_only in _COLLECTIVES)
    return _collective_patches
