"""Engine core: predict every step's energy and put each request's running total on its output.

`Scheduler.schedule` is wrapped to read, right after scheduling, what each request computes in
the step (vLLM advances `num_computed_tokens` at schedule time, so the context before the step
is `num_computed_tokens - scheduled`). `Scheduler.update_from_output` is wrapped to predict the
step once its output is back, split it among the requests, and attach each request's
cumulative record to its `EngineCoreOutput.kv_transfer_params["piep"]` (the API server pops it
before vLLM reads the field). Only this file and its siblings import vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_piep.accounting import EngineAccountant
from vllm_piep.config import PiepConfig
from vllm_piep.flops import ModelShape, StepBatch
from vllm_piep.hooks.patching import Patch
from vllm_piep.hooks.worker import STEP_NS_ATTR
from vllm_piep.once import OnceLogger
from vllm_piep.predict.base import Predictor
from vllm_piep.predict.loader import load_predictor
from vllm_piep.wire import HEADER_KEY, RECORD_KEY

_ATTR = "_piep_accountant"
_SWEEP_EVERY = 256  # steps between sweeps for requests aborted without a final output
_once = OnceLogger()


def model_shape(vllm_config: Any) -> ModelShape:
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return ModelShape.from_hf_config(
        model_config.hf_text_config.to_dict(),
        dtype_bytes=int(model_config.dtype.itemsize),
        tp=int(parallel.tensor_parallel_size),
        pp=int(parallel.pipeline_parallel_size),
        dp=int(parallel.data_parallel_size),
    )


def _device() -> tuple[str, str | None]:
    from vllm.platforms import current_platform

    device_type = str(current_platform.device_type)
    if device_type == "cpu":
        return device_type, None
    return device_type, str(current_platform.get_device_name())


def accountant(scheduler: Any) -> EngineAccountant:
    acc = scheduler.__dict__.get(_ATTR)
    if acc is None:
        vllm_config = scheduler.vllm_config

        def make_predictor() -> Predictor:
            config = PiepConfig.from_sources(vllm_config.additional_config)
            device_type, device_name = _device()
            architecture = (vllm_config.model_config.architectures or [None])[0]
            return load_predictor(config, model_shape(vllm_config), device_type, device_name,
                                  architecture)

        dp_rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0)
        acc = EngineAccountant(make_predictor, engine_id=str(dp_rank))
        setattr(scheduler, _ATTR, acc)
    return acc


def _step_batch(scheduler: Any, scheduler_output: Any) -> tuple[list[str], StepBatch]:
    requests = scheduler.requests
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    ids = list(scheduler_output.num_scheduled_tokens)
    rows = []
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        req = requests[req_id]
        end = req.num_computed_tokens  # already advanced by this step at schedule time
        start = end - n
        in_prompt = min(end, req.num_prompt_tokens) - start
        if in_prompt < 0:
            in_prompt = 0
        sampled = 1 + len(spec_tokens.get(req_id, ())) if end >= req.num_tokens else 0
        rows.append((in_prompt, n - in_prompt, start, sampled))
    return ids, StepBatch.from_rows(rows)


def _wrap_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        try:
            if out.total_num_scheduled_tokens > 0:
                ids, batch = _step_batch(self, out)
                accountant(self).on_schedule(id(out), ids, batch)
        except Exception as exc:  # boundary: never break scheduling
            _count_failure(self, "reading the scheduled step", exc)
            try:
                accountant(self).mark_incomplete(out.num_scheduled_tokens)
            except Exception:
                pass  # already counted and logged above
        return out

    return schedule


def _wrap_update_from_output(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any,
                           *args: Any, **kwargs: Any) -> Any:
        try:
            step_ns = getattr(model_runner_output, STEP_NS_ATTR, None)
            accountant(self).on_step_done(id(scheduler_output), step_ns)
        except Exception as exc:  # boundary
            _count_failure(self, "accounting a step", exc)
        outputs = original(self, scheduler_output, model_runner_output, *args, **kwargs)
        try:
            _attach_records(self, outputs)
        except Exception as exc:  # boundary
            _count_failure(self, "attaching energy records", exc)
        return outputs

    return update_from_output


def _attach_records(scheduler: Any, outputs: dict[int, Any]) -> None:
    acc = accountant(scheduler)
    header = acc.header().encode()
    for engine_outputs in outputs.values():
        outs = engine_outputs.outputs
        if not outs:
            continue
        rows = acc.encode_rows([out.request_id for out in outs])
        for i, out in enumerate(outs):
            extra = {RECORD_KEY: rows[i], HEADER_KEY: header} if i == 0 else {RECORD_KEY: rows[i]}
            params = out.kv_transfer_params
            out.kv_transfer_params = {**params, **extra} if params else extra
            if out.finish_reason is not None:
                acc.release(out.request_id)
    if acc.steps % _SWEEP_EVERY == 0:
        acc.sweep(scheduler.requests)


def _count_failure(scheduler: Any, where: str, exc: BaseException) -> None:
    try:
        accountant(scheduler).errors += 1
    except Exception:
        pass
    _once.warn(where, exc, "energy of the affected requests may be missing")


def patches() -> list[Patch]:
    from vllm.v1.core.sched.scheduler import Scheduler

    return [
        Patch(Scheduler, "schedule", _wrap_schedule,
              why="captures each scheduled request's new tokens and context for the step"),
        Patch(Scheduler, "update_from_output", _wrap_update_from_output,
              why="predicts the step's energy, splits it, attaches running totals to outputs"),
    ]
