"""Each engine core meters exactly the GPUs its workers run on, by vLLM's own rule
(`ParallelConfig.get_local_gpu_index`, called by `runtime/engine_core/engine_gpus.py`), for the
deployments operators run: data parallel on one node with tensor parallel (`-dp 2 -tp 4`), data
parallel with expert parallelism on eight GPUs (`-dp 8 --enable-expert-parallel`, how
DeepSeek- and Qwen3-MoE-class models are served), and data parallel across two nodes. Each
engine's meter is the one the engine core builds (`meters.factory`, NVML chosen by `auto` for
the instance's GPUs) over a stand-in NVML of 8 GPUs whose counters advance at different rates:
the engines' metered energy adds up to the 8 GPUs', each once. An engine whose workers span
nodes (tensor parallel 16 on two 8-GPU nodes) has each worker meter its own GPU by default
(`meter_scope: auto`; the engine binds the sink for their readings before it starts them), and
stays in prediction mode with one warning when told to meter itself (`engine`)."""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("vllm")

from support.fake_pynvml import FakeGpu, FakeNvml  # noqa: E402
from vllm.config import ParallelConfig  # noqa: E402

from vllm_piep.meters.factory import meter_factory  # noqa: E402
from vllm_piep.runtime.engine_core.engine_gpus import engine_gpus  # noqa: E402

needs_rule = pytest.mark.skipif(not hasattr(ParallelConfig, "get_local_gpu_index"),
                                reason="this vLLM has no get_local_gpu_index (0.32): its DP "
                                       "engines are metered by ranks 0..world-1")
GPUS_PER_NODE = 8
# name: (ParallelConfig arguments, nodes, engines per node)
DEPLOYMENTS = {
    "dp2-tp4": (dict(tensor_parallel_size=4, data_parallel_size=2,
                     data_parallel_size_local=2), 1, 2),
    "dp8-ep": (dict(data_parallel_size=8, data_parallel_size_local=8,
                    enable_expert_parallel=True), 1, 8),
    "dp4-tp4-two-nodes": (dict(tensor_parallel_size=4, data_parallel_size=4,
                               data_parallel_size_local=2, nnodes=2), 2, 2),
}


def engine_config(args: dict, node: int, local: int, per_node: int) -> ParallelConfig:
    """An engine's ParallelConfig as its engine-core process has it: vLLM sets the DP local
    rank and index there (`EngineCoreProc.run_engine_core`)."""
    extra = {"node_rank": node} if args.get("nnodes", 1) > 1 else {}
    config = ParallelConfig(**args, **extra)
    config.data_parallel_rank_local = local
    config.data_parallel_index = node * per_node + local
    return config


@pytest.fixture
def node_nvml(monkeypatch: pytest.MonkeyPatch):
    """A node's stand-in NVML at the `pynvml` seam: 8 GPUs, GPU i drawing 100 + 37 i W."""
    gpus = [FakeGpu(name="NVIDIA H100 80GB HBM3", manual_mj=1_000_000)
            for _ in range(GPUS_PER_NODE)]
    nvml = FakeNvml(gpus)
    module = types.ModuleType("pynvml")
    module.__getattr__ = lambda name: getattr(nvml, name)  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return gpus


@needs_rule
@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_every_engine_meters_its_own_gpus_and_each_gpu_once(deployment: str, node_nvml) -> None:
    args, nodes, per_node = DEPLOYMENTS[deployment]
    for node in range(nodes):  # each node's engines read that node's NVML
        for gpu in node_nvml:
            gpu.manual_mj = 1_000_000
        meters, owned = [], []
        for local in range(per_node):
            gpus = engine_gpus(engine_config(args, node, local, per_node))
            assert gpus.kind == "cuda" and gpus.elsewhere == 0
            factory, label = meter_factory("auto", gpus.ids, measuring_only=True)
            meter = factory()
            meter.start()
            meters.append((meter, meter.read()))
            owned.append(set(gpus.ids))
        # The engines' GPUs are disjoint and cover the node's GPUs the deployment uses.
        assert sum(len(o) for o in owned) == len(set().union(*owned)) == GPUS_PER_NODE
        watts = [100 + 37 * i for i in range(GPUS_PER_NODE)]
        for gpu, w in zip(node_nvml, watts, strict=True):
            gpu.manual_mj += w * 1000  # one second
        metered = []
        for meter, first in meters:
            metered.append(meter.read().total - first.total)
            meter.stop()
        assert sum(metered) == pytest.approx(sum(watts), rel=1e-12)
        for joules, gpus in zip(metered, owned, strict=True):  # each engine its own GPUs'
            assert joules == pytest.approx(sum(watts[i] for i in gpus), rel=1e-12)


@needs_rule
def test_an_engine_told_to_meter_itself_across_nodes_stays_in_prediction_mode(
        node_nvml, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from vllm_piep.runtime.engine_core import measured_start
    from vllm_piep.runtime.engine_core.accountant import EngineAccountant

    config = ParallelConfig(tensor_parallel_size=16, nnodes=2, node_rank=0)
    gpus = engine_gpus(config)
    assert (gpus.ids, gpus.elsewhere) == (tuple(range(8)), 8)
    monkeypatch.setattr(measured_start, "device", lambda ordinal=0: ("cuda", "NVIDIA H100"))
    acc = EngineAccountant(lambda: None)
    engine = SimpleNamespace(scheduler=SimpleNamespace(vllm_config=SimpleNamespace(
        additional_config={"piep": {"meter_scope": "engine"}}, parallel_config=config)),
        output_queue=None)
    with caplog.at_level("WARNING", logger="vllm"):
        measured_start.start_engine_meter(engine, acc, flush=lambda: None)
    assert acc.engine_meter is None and acc.splitter is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "8 of the engine's 16 workers run on other nodes" in \
        warnings[0] and "prediction mode" in warnings[0]
    assert "meter_scope" in warnings[0]  # what to do about it
    header = acc.header(counts=False)
    assert header.meter is None and header.meter_note == acc.meter_note


@needs_rule
def test_by_default_workers_on_other_nodes_meter_themselves() -> None:
    from vllm_piep.config import PiepConfig
    from vllm_piep.runtime.engine_core.patch_executor_init import worker_scope

    two_nodes = ParallelConfig(tensor_parallel_size=16, nnodes=2, node_rank=0)
    one_node = ParallelConfig(tensor_parallel_size=2)
    assert worker_scope(PiepConfig(), two_nodes, on_gpu=True)
    assert not worker_scope(PiepConfig(meter_scope="engine"), two_nodes, on_gpu=True)
    assert not worker_scope(PiepConfig(), one_node, on_gpu=True)
    assert not worker_scope(PiepConfig(), two_nodes, on_gpu=False)  # a CPU: RAPL is per node
    assert worker_scope(PiepConfig(meter_scope="worker"), one_node, on_gpu=False)
    assert not worker_scope(PiepConfig(meter_scope="worker", measured=False), one_node, True)


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_sink_is_bound_before_the_workers_start_and_named_to_them(
        nodes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Executor.__init__` wrapped: the sink exists, and its address (with its token) is in
    the environment the workers inherit, reachable from other nodes where there are some."""
    import os
    from types import SimpleNamespace

    from vllm_piep.meters.worker_readings import SINK_ENV
    from vllm_piep.runtime.engine_core import patch_executor_init

    monkeypatch.delenv(SINK_ENV, raising=False)
    extra = {"nnodes": 2, "node_rank": 0} if nodes > 1 else {}
    parallel = ParallelConfig(tensor_parallel_size=2 * nodes, **extra)
    started = {}

    def original(self, vllm_config):  # what the executor's own __init__ sees
        started["env"] = os.environ.get(SINK_ENV)

    executor = SimpleNamespace()
    vllm_config = SimpleNamespace(additional_config={"piep": {"meter_scope": "worker"}},
                                  parallel_config=parallel)
    patch_executor_init._wrap_init(original)(executor, vllm_config)
    sink = getattr(executor, patch_executor_init.SINK_ATTR)
    try:
        assert sink is not None and started["env"] == sink.address
        host = sink.address.removeprefix("tcp://").rpartition(":")[0]
        assert (host == "127.0.0.1") == (nodes == 1), sink.address
        assert len(sink.address.partition("#")[2]) == 32  # its token
    finally:
        sink.close()


def test_a_node_of_workers_only_finds_the_head_through_vllms_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own multi-node launch (`--nnodes 2`; node 1 runs `vllm serve --headless`): the
    executor on node 1 binds no sink of its own and exports nothing, and what its workers
    read to find the head's (`runtime/worker/sink_address.py`) is in vLLM's ParallelConfig:
    the nodes in the engine, this node's place, the world group's store address, the engine's
    data-parallel rank."""
    import os
    from types import SimpleNamespace

    from vllm_piep.meters.worker_readings import SINK_ENV
    from vllm_piep.runtime.engine_core import patch_executor_init
    from vllm_piep.runtime.worker.sink_address import _key, across_nodes

    monkeypatch.delenv(SINK_ENV, raising=False)
    head = ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=0,
                          master_addr="10.0.0.1", master_port=29511)
    other = ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1,
                           master_addr="10.0.0.1", master_port=29511)
    assert across_nodes(head) and across_nodes(other)
    assert not across_nodes(ParallelConfig(tensor_parallel_size=4))
    assert (head.node_rank_within_dp, other.node_rank_within_dp) == (0, 1)
    assert (other.master_addr, other.master_port) == ("10.0.0.1", 29511)
    assert _key(head) == _key(other) == "vllm_piep/worker_meter_sink/dp0"
    seen = {}
    executor = SimpleNamespace()
    patch_executor_init._wrap_init(lambda self, config: seen.update(
        env=os.environ.get(SINK_ENV)))(executor, SimpleNamespace(
            additional_config={"piep": {"meter_scope": "worker"}}, parallel_config=other))
    assert getattr(executor, patch_executor_init.SINK_ATTR) is None and seen == {"env": None}


def test_the_rule_is_vllms_where_it_has_one() -> None:
    """0.33 offsets a DP engine's workers by its local rank; without the rule (0.32) every
    engine's ranks start at 0, and the module says so."""
    config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                            data_parallel_size_local=2)
    config.data_parallel_rank_local, config.data_parallel_index = 1, 1
    gpus = engine_gpus(config)
    if hasattr(ParallelConfig, "get_local_gpu_index"):
        assert gpus.ids == (2, 3) and "get_local_gpu_index" in gpus.rule and not gpus.unknown
    else:  # two engines on the node, told apart by no rule: neither is metered
        assert gpus.ids == (0, 1) and "cannot be told apart" in gpus.unknown


def test_device_ids_give_nvml_indices() -> None:
    config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
    config.data_parallel_rank_local, config.data_parallel_index = 1, 1
    config.assigned_physical_gpu_ids = [7, 6, 5, 4]
    gpus = engine_gpus(config)
    want = (5, 4) if hasattr(ParallelConfig, "get_local_gpu_index") else (7, 6)
    assert (gpus.kind, gpus.ids) == ("nvml", want)

