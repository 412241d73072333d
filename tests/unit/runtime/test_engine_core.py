"""The engine core's part in serving several API servers and data-parallel engines: the idle
flush that sends an idle engine's last counts, and each engine's share of the CPU socket."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest

from vllm_piep.model.devices import DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape, StepBatch
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.record import HEADER_KEY, ROWS_KEY, StepHeader
from vllm_piep.runtime.vllm_config import engine_cpu_cores

pytest.importorskip("vllm")

from vllm_piep.runtime.engine_core import patch_notify_idle, scheduler_accountant  # noqa: E402

SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=4)


def engine_with(acc: EngineAccountant | None) -> SimpleNamespace:
    scheduler = SimpleNamespace()
    if acc is not None:
        scheduler.__dict__[scheduler_accountant.ACCOUNTANT_ATTR] = acc
    return SimpleNamespace(scheduler=scheduler, output_queue=queue.Queue())


def test_an_idle_engine_sends_what_it_has_not_sent_once() -> None:
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior, clock_ns=lambda: 0)
    engine = engine_with(acc)
    patch_notify_idle.flush_idle(engine)
    assert engine.output_queue.empty()  # nothing happened yet
    acc.on_schedule(1, ["a"], StepBatch.from_lists([10], [0], [0], [1]))
    acc.on_step_done(1, 1_000_000, "perf_counter")
    acc.release("a")  # aborted while the engine went idle: unsent energy, tracked back to 0
    acc.reports.client = 1
    patch_notify_idle.flush_idle(engine)
    client, outputs = engine.output_queue.get_nowait()
    (output,) = outputs.outputs
    assert client == 1 and output.request_id == patch_notify_idle.FLUSH_REQUEST_ID
    header = StepHeader.decode(output.kv_transfer_params[HEADER_KEY])
    assert output.kv_transfer_params[ROWS_KEY] == b""
    assert header.carries_counts and header.tracked == 0
    assert acc.total_joules > 0 and header.step_joules == pytest.approx(acc.total_joules)
    assert header.unsent_joules == pytest.approx(acc.total_joules)
    patch_notify_idle.flush_idle(engine)  # sent once
    assert engine.output_queue.empty()
    patch_notify_idle.flush_idle(engine_with(None))  # an engine the plugin has not seen: nothing
    in_process = SimpleNamespace(scheduler=engine.scheduler)  # no output queue
    patch_notify_idle.flush_idle(in_process)


def test_the_engine_starts_its_accounting_when_it_starts_serving(monkeypatch) -> None:
    """When a built engine-core process starts its busy loop, its accountant sends on its
    output queue and measured mode is started (once, whichever loop runs), not at the first
    idle moment; an in-process engine (no output queue) is left alone, and a meter that
    cannot start leaves the engine serving."""
    from vllm_piep.runtime.engine_core import patch_run_busy_loop

    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior)
    engine = engine_with(acc)
    engine.scheduler.vllm_config = object()
    started: list[object] = []
    monkeypatch.setattr(patch_run_busy_loop, "start_engine_meter",
                        lambda engine_, acc_, flush: started.append((engine_, acc_)))
    built = patch_run_busy_loop._wrap_run_busy_loop(lambda self: None)
    built(engine)
    built(engine)  # a subclass's loop calling its parent's: started once
    assert started == [(engine, acc)] and acc.put_outputs is not None
    acc.put_outputs(0, [])
    assert engine.output_queue.get_nowait()[0] == 0
    in_process = SimpleNamespace(scheduler=engine.scheduler)
    built(in_process)
    assert len(started) == 1

    def broken(*args: object) -> None:
        raise RuntimeError("no meter here")

    monkeypatch.setattr(patch_run_busy_loop, "start_engine_meter", broken)
    other = engine_with(EngineAccountant(lambda: prior))
    other.scheduler.vllm_config = object()
    built(other)  # the engine still starts, said once, in prediction mode
    assert other.scheduler.__dict__[scheduler_accountant.ACCOUNTANT_ATTR].splitter is None


def test_an_idle_engine_releases_what_the_scheduler_no_longer_has() -> None:
    """A request left tracked (an abort that raced a step) is released when the engine goes
    idle, not at the next request's sweep: its energy is counted and the gauge reads 0."""
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior, clock_ns=lambda: 0)
    engine = engine_with(acc)
    engine.scheduler.requests = {"b": object()}
    acc.on_schedule(1, ["a", "b"], StepBatch.from_lists([10, 4], [0, 0], [0, 0], [1, 1]))
    acc.on_step_done(1, 1_000_000, "perf_counter")
    assert acc.tracked_requests == 2
    patch_notify_idle.flush_idle(engine)
    header = StepHeader.decode(engine.output_queue.get_nowait()[1].outputs[0]
                               .kv_transfer_params[HEADER_KEY])
    assert acc.tracked_requests == 1 and header.tracked == 1  # "b" is still the scheduler's
    assert 0 < header.unsent_joules < acc.total_joules  # "a"'s share, counted


def config(tp: int = 1, pp: int = 1, dp_local: int = 1, dp_rank_local: int = 0,
           dp_index: int | None = None):
    return SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size_local=dp_local,
        data_parallel_rank_local=dp_rank_local, data_parallel_index=dp_index))


def test_each_data_parallel_engine_counts_its_own_cores() -> None:
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert engine_cpu_cores(config(dp_local=2, dp_rank_local=0), bind) == 1
    assert engine_cpu_cores(config(dp_local=2, dp_rank_local=1), bind) == 1
    assert engine_cpu_cores(config(tp=2), bind) == 2  # TP=2 on one engine: both cores
    # A dense model's DP ranks run as independent engines (rank 0 of 1); the index says which.
    assert engine_cpu_cores(config(dp_index=1), {"VLLM_CPU_OMP_THREADS_BIND": "0|1-3"}) == 3
    assert engine_cpu_cores(config(dp_local=2, dp_rank_local=1),
                            {"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7,9"}) == 5
    # auto / nobind: the host's cores shared by the local engines
    assert engine_cpu_cores(config(dp_local=2), {}, available=8) == 4
    assert engine_cpu_cores(config(), {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, available=8) == 8
    # The same work costs the same static power with one engine on two cores as with two
    # engines on one core each.
    two = cpu_spec(cores=engine_cpu_cores(config(), bind | {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}))
    one = cpu_spec(cores=engine_cpu_cores(config(dp_local=2), bind))
    assert 2 * one.static_watts == pytest.approx(two.static_watts)


def _vllm_config(hf: dict, tp: int = 1, dp: int = 1, ep: bool = False) -> SimpleNamespace:
    import numpy as np

    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(to_dict=lambda: hf),
                                     dtype=np.dtype("float16")),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                        data_parallel_size=dp, enable_expert_parallel=ep))


_MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "num_experts": 16,
        "num_experts_per_tok": 4}


def test_shape_of_an_expert_parallel_moe_deployment() -> None:
    from vllm_piep.runtime.vllm_config import model_shape

    shape = model_shape(_vllm_config(_MOE, tp=2, dp=2, ep=True))
    assert shape.is_moe and shape.ep == 4 and not shape.notes
    assert model_shape(_vllm_config(_MOE, tp=2)).ep == 1


def test_a_config_the_shape_cannot_read_is_priced_dense_and_said(caplog) -> None:
    from vllm_piep.runtime.vllm_config import model_shape

    broken = {k: v for k, v in _MOE.items() if k != "num_experts_per_tok"}
    shape = model_shape(_vllm_config(broken))
    assert not shape.is_moe and "num_experts_per_tok" in shape.notes[-1]
    prior = PriorPredictor(shape, DeviceProfile.from_spec(cpu_spec(cores=2), 2))
    assert "num_experts_per_tok" in prior.bundle_id and "dense" in prior.bundle_id
