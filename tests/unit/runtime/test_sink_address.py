"""Workers on other nodes than the engine core's, under vLLM's multi-node launch (`--nnodes`,
`--headless`), find the engine core's sink for their meter readings through the world group's
store (`runtime/worker/sink_address.py`), here a real torch TCPStore: rank 0 publishes the
address, or that there is none; the other nodes' workers read it on their sender's thread and
their readings reach the engine core's sink; a worker whose rank 0 never answers does not meter
itself, and says so once."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from vllm_piep.meters.simulated import SimTrace, SimulatedMeter
from vllm_piep.meters.worker_readings import SINK_ENV, ReadingSink, WorkerMeter
from vllm_piep.runtime.worker import patch_initialize_from_config as worker_patch
from vllm_piep.runtime.worker.sink_address import publish, resolve


def constant_meter() -> SimulatedMeter:
    """The meter each test worker builds (`meter: test_sink_address:constant_meter`)."""
    return SimulatedMeter({"gpu": SimTrace(100.0, 0.0, 1.0)})


@pytest.fixture
def store() -> dist.TCPStore:
    """The world group's store, as rank 0's process serves it."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def parallel(store: dist.TCPStore, dp: int = 0, node: int = 0) -> SimpleNamespace:
    return SimpleNamespace(master_addr="127.0.0.1", master_port=store.port,
                           data_parallel_rank=dp, nnodes_within_dp=2, node_rank_within_dp=node,
                           world_size=2, local_world_size=1, distributed_executor_backend="mp")


def test_rank_0s_answer_reaches_the_other_nodes_per_data_parallel_engine(store) -> None:
    publish(parallel(store), "tcp://10.0.0.1:5555#token")
    publish(parallel(store, dp=1), None)  # that engine meters itself: its workers do not
    assert resolve(parallel(store), 5.0) == "tcp://10.0.0.1:5555#token"
    assert resolve(parallel(store, dp=1), 5.0) is None
    with pytest.raises(Exception, match="(?i)timeout|timed out|wait"):
        resolve(parallel(store, dp=2), 0.3)  # no engine answered


def worker(store: dist.TCPStore, rank: int) -> SimpleNamespace:
    config = {"piep": {"meter": "test_sink_address:constant_meter", "meter_scope": "worker"}}
    return SimpleNamespace(rank=rank, device=None, vllm_config=SimpleNamespace(
        additional_config=config, parallel_config=parallel(store, node=rank)))


def test_a_worker_on_another_node_sends_its_readings_to_the_engine_cores_sink(
        store, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = ReadingSink()
    meter = WorkerMeter(sink.readings, [0, 1], start_s=60, on_stop=sink.close)
    senders = []
    try:
        monkeypatch.setenv(SINK_ENV, sink.address)  # the engine core's node: inherited
        senders.append(worker_patch.start_sender(worker(store, 0)))
        monkeypatch.delenv(SINK_ENV)  # the other node: its own `vllm serve` exported nothing
        senders.append(worker_patch.start_sender(worker(store, 1)))
        meter.start()  # both ranks' readings arrived
        store_ = sink.readings
        with store_.lock:
            assert store_.arrived.wait_for(lambda: all(len(store_.ranks[r].t) >= 3
                                                       for r in (0, 1)), 60)
    finally:
        for sender in senders:
            if sender is not None:
                sender.stop()
        meter.stop()
    assert meter.name == "workers (simulated)"
    assert all(s is not None and s.address == sink.address.partition("#")[0] for s in senders)


def test_a_worker_whose_engine_never_answers_does_not_meter_and_says_so(
        store, monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(SINK_ENV, raising=False)
    monkeypatch.setattr(worker_patch.sink_address, "resolve",
                        lambda p: resolve(p, timeout_s=0.3))
    caplog.set_level(logging.INFO)
    sender = worker_patch.start_sender(worker(store, 1))
    assert sender is not None and sender._thread is not None
    sender._thread.join(30)
    assert not sender._thread.is_alive() and sender.sent == 0
    assert "worker rank 1 found no address for its meter readings" in caplog.text
    assert not any(t.name == "piep-worker-meter" and t.is_alive()
                   for t in threading.enumerate())
