"""The worker's step clock and how its time reaches the engine, against the stand-in CUDA stream
(`support/fake_cuda.py`, put where `torch.cuda.Event` and `torch.cuda.current_stream` sit): GPU
time, not host time; steps launched before the previous one finished (async scheduling) get
disjoint intervals; events are reused only once read; a plain output and the one model runner
V2's async output holds are stamped when the step's last call returns, another async one when
vLLM asks it for its result, an output without requests never; a GPU time crosses processes as
its number; a step whose time never arrives is counted under the engine's fallback."""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass, field

import pytest
from support import fake_cuda
from support.fake_cuda import STREAM, FakeCudaEvent, ManualClock

from vllm_piep.model.devices import GPU_SPECS, DeviceProfile
from vllm_piep.model.flops import ModelShape, StepBatch
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.worker.recorder import CudaEventTimer
from vllm_piep.runtime.worker.step import STEP_TIME_ATTR, deliver, read_step_time
from vllm_piep.runtime.worker.steptime import (
    HOST_TIMER,
    CudaStepClock,
    HostStepClock,
    KnownStepTime,
    step_clock,
)


@pytest.fixture
def cuda_events(monkeypatch):
    """The stand-in stream on a clock of its own: GPU time moves only as the test moves it or
    waits for the stream, however fast this machine runs the test."""
    import torch

    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: STREAM)
    monkeypatch.setattr(fake_cuda, "log", lambda record: None)
    monkeypatch.setattr(STREAM, "clock", ManualClock())
    monkeypatch.setattr(STREAM, "tail_ns", 0)
    monkeypatch.setattr(STREAM, "held_from_ns", None)


@dataclass
class Output:  # the fields of ModelRunnerOutput the plugin touches
    req_ids: list[str] = field(default_factory=lambda: ["r"])


class AsyncOutput:
    """An async output that makes its result when asked (V1's `AsyncGPUModelRunnerOutput`)."""

    def __init__(self, result: Output, ready_ns: int) -> None:
        self.result, self.ready_ns = result, ready_ns

    def get_output(self) -> Output:
        STREAM.clock.wait_until(self.ready_ns)  # the copy of the sampled tokens
        return self.result


class AsyncOutputV2(AsyncOutput):
    """Model runner V2's `AsyncOutput`: holds the output it hands over as `model_runner_output`
    (vLLM 0.33, `v1/worker/gpu/async_utils.py`; the contract suite checks it)."""

    def __init__(self, result: Output, ready_ns: int) -> None:
        super().__init__(result, ready_ns)
        self.model_runner_output = result


def test_clock_by_device() -> None:
    assert isinstance(step_clock("cuda"), CudaStepClock)
    assert isinstance(step_clock("cpu"), HostStepClock)


def test_cuda_step_time_is_gpu_time_and_overlapping_steps_are_disjoint(cuda_events) -> None:
    clock = CudaStepClock()
    # Step 1 on an idle GPU: 3 ms of work.
    clock.begin()
    STREAM.launch(3_000_000)
    first = clock.end()
    # Step 2 launched at once, while step 1 still runs (async scheduling): 2 ms of work.
    clock.begin()
    STREAM.launch(2_000_000)
    second = clock.end()
    assert first is not None and second is not None
    assert second.ns() == 2_000_000  # waits for its own end; starts where step 1 ended
    # On an idle GPU the start event runs at once (here the launch takes no time).
    assert first.ns() == 3_000_000
    assert first.timer == second.timer == "cuda_event"


def test_a_split_step_is_one_interval_on_the_gpu_and_a_sum_of_calls_on_the_host(
        cuda_events) -> None:
    cuda = CudaStepClock()
    cuda.begin()
    STREAM.launch(1_000_000)
    cuda.pause()  # execute_model returned None; the engine works on the host meanwhile
    STREAM.clock.wait_until(STREAM.tail_ns)  # the GPU done with the first call's work ...
    STREAM.clock.advance(2_000_000)  # ... and idle for 2 ms
    assert cuda.resume()
    STREAM.launch(1_000_000)
    time_cuda = cuda.end()
    assert time_cuda is not None and time_cuda.ns() == 4_000_000  # the GPU idled in the gap
    host = HostStepClock()
    assert not host.resume() and host.end() is None  # sample_tokens without execute_model
    host.begin()
    time.sleep(0.002)
    host.pause()
    time.sleep(0.05)  # the engine's own time is not the step's
    assert host.resume()
    time.sleep(0.002)
    spent = host.end()
    assert spent is not None and 4_000_000 <= spent.ns() < 50_000_000


def test_a_cpu_workers_split_step_leaves_out_the_engines_time_between_its_calls() -> None:
    """Through the wrappers: on a host clock the time between `execute_model` returning
    nothing and `sample_tokens` (the engine's grammar masks, its next schedule) is not the
    step's."""
    from vllm_piep.runtime.worker.step import _wrap_execute_model, _wrap_sample_tokens

    class Worker:
        device = "cpu"

    def forward(self, so):
        time.sleep(0.002)

    def sampling(self, grammar):
        time.sleep(0.002)
        return result

    worker, result = Worker(), Output()
    execute, sample = _wrap_execute_model(forward), _wrap_sample_tokens(sampling)
    assert execute(worker, object()) is None
    time.sleep(0.1)  # the engine's own time
    assert sample(worker, None) is result
    step_ns, timer = read_step_time(result)
    assert timer == HOST_TIMER and step_ns is not None and 4_000_000 <= step_ns < 100_000_000


def test_deliver_stamps_plain_and_async_outputs_but_never_an_empty_one(cuda_events) -> None:
    plain = Output()
    deliver(plain, KnownStepTime(5, HOST_TIMER))
    assert read_step_time(plain) == (5, "perf_counter")

    empty = Output(req_ids=[])  # vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT has no requests
    deliver(empty, KnownStepTime(5, HOST_TIMER))
    assert not hasattr(empty, STEP_TIME_ATTR) and read_step_time(empty) == (None, None)

    for kind in (AsyncOutputV2, AsyncOutput):
        clock = CudaStepClock()
        clock.begin()
        ready = STREAM.launch(1_000_000)  # sampling: the tokens are copied out here
        STREAM.launch(1_000_000, held=True)  # postprocessing after the copy, still the step's
        time_ = clock.end()
        result = Output()
        pending = kind(result, ready)
        deliver(pending, time_)
        # Model runner V2's output is stamped before vLLM waits for the device; another
        # async output only when vLLM asks it for its result.
        assert hasattr(result, STEP_TIME_ATTR) == (kind is AsyncOutputV2)
        assert pending.get_output() is result
        step_ns, timer = read_step_time(result)  # as the engine core reads it, off its loop
        assert step_ns == 2_000_000
        assert timer == "cuda_event"
        assert time_.waited  # the end event ran after the copy: the step's own tail


def test_a_gpu_step_time_crosses_processes_as_its_number_read_where_it_is_sent(
        cuda_events) -> None:
    """The multiprocess and Ray executors pickle the output in the worker's output thread: the
    events are read there and the number goes; one that cannot be read goes as no time."""
    errors: list[BaseException] = []
    clock = CudaStepClock(errors.append)
    clock.begin()
    STREAM.launch(1_500_000)
    output = Output()
    deliver(output, clock.end())
    received = pickle.loads(pickle.dumps(output))
    assert type(getattr(received, STEP_TIME_ATTR)) is KnownStepTime
    step_ns, timer = read_step_time(received)
    assert step_ns == 1_500_000 and timer == "cuda_event"
    assert read_step_time(output) == (step_ns, timer)  # read once, on the sending side

    clock.begin()
    broken = Output()
    deliver(broken, clock.end())
    getattr(broken, STEP_TIME_ATTR)._end = None  # its end event is gone
    received = pickle.loads(pickle.dumps(broken))
    assert getattr(received, STEP_TIME_ATTR) is None and len(errors) == 1
    assert read_step_time(received) == (None, None)


def test_events_are_reused_once_read_and_the_stream_is_looked_up_once(monkeypatch) -> None:
    """Neither an event nor a stream object is made per step on the loop; an event goes back to
    the pool only after its step was read, so steps in flight never share one."""
    import torch

    made: list[FakeCudaEvent] = []
    streams: list[int] = []

    def event(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(FakeCudaEvent(*args, **kwargs))
        return made[-1]

    def current_stream():  # type: ignore[no-untyped-def]
        streams.append(1)
        return STREAM

    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(fake_cuda, "log", lambda record: None)
    clock = CudaStepClock()
    in_flight = []
    def events(step):  # type: ignore[no-untyped-def]
        return {id(step._start), id(step._end)}

    for _ in range(3):  # async scheduling: three steps launched before any is read
        clock.begin()
        STREAM.launch(1_000_000)
        in_flight.append(clock.end())
    assert len(made) == 6 and len({id(e) for e in made}) == 6
    first = in_flight.pop(0)
    assert first is not None and first.ns() >= 1_000_000
    for _ in range(60):  # then one read per step launched, as the engine goes
        clock.begin()
        STREAM.launch(1_000_000)
        step = clock.end()
        assert step is not None
        assert not events(step) & set().union(*map(events, in_flight))  # none in flight
        in_flight.append(step)
        read = in_flight.pop(0)
        assert read is not None and read.ns() >= 1_000_000
    assert len(made) == 6 and streams == [1]


def test_span_timer_anchors_a_step_queued_behind_the_previous_one(cuda_events) -> None:
    timer = CudaEventTimer()
    start1 = timer.mark()
    STREAM.launch(4_000_000)
    end1 = timer.mark()
    recorded2 = STREAM.clock.now()
    start2 = timer.mark()  # recorded now, runs when step 1's work is done
    STREAM.launch(1_000_000)
    end2 = timer.mark()
    t1 = timer.resolver(start1.done_ns, start1)
    timer.step_done(end1, t1(end1))
    t2 = timer.resolver(recorded2, start2)
    assert t2(start2) == pytest.approx(t1(end1), abs=1_000)  # not its recording time
    assert t2(start2) - recorded2 > 3_000_000
    assert t2(end2) - t2(start2) == 1_000_000


SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=2)


def test_a_step_without_worker_time_is_counted_and_said_once(caplog) -> None:
    profile = DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], 2)
    clock = [0]
    acc = EngineAccountant(lambda: PriorPredictor(SHAPE, profile), clock_ns=lambda: clock[0])
    batch = StepBatch.from_lists([0], [1], [10], [1])
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        for key in range(3):
            acc.on_schedule(key, ["a"], batch)
            clock[0] += 1_000_000
            acc.on_step_done(key, None if key else 2_000_000, "cuda_event")
    assert acc.steps_table.by_timer == {"cuda_event": 1, "perf_counter": 0, "engine_clock": 2}
    assert acc.header().steps_by_timer == (1, 0, 2)
    assert caplog.text.count("without the worker's step time") == 1
    # The static energy follows the time each step was given: 2 ms, then 1 ms and 1 ms.
    static = acc.record("a").components[-1]
    assert static == pytest.approx(profile.static_watts * 0.004, rel=1e-12)


def test_a_cuda_clock_whose_event_fails_leaves_that_step_untimed_and_never_raises(
        monkeypatch) -> None:
    """The wrappers call the clock without a `try`: a CUDA error while making the start or the
    end event goes to `on_error`, and that step has no time (the engine times it, counted)."""
    import torch

    made: list[int] = []

    def event_failing_on(*failing: int):  # type: ignore[no-untyped-def]
        def event(*args, **kwargs):  # type: ignore[no-untyped-def]
            made.append(1)
            if len(made) in failing:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return FakeCudaEvent(*args, **kwargs)

        return event

    monkeypatch.setattr(fake_cuda, "log", lambda record: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: STREAM)
    errors: list[BaseException] = []
    clock = CudaStepClock(errors.append)
    monkeypatch.setattr(torch.cuda, "Event", event_failing_on(1, 5))
    clock.begin()  # the start event fails
    assert not clock.resume() and clock.end() is None and len(errors) == 1
    clock.begin()  # the next step's start is made
    assert clock.resume() and clock.end() is not None and len(errors) == 1
    clock.begin()
    assert clock.end() is None and len(errors) == 2  # its end event fails
    assert clock.end() is None  # and the step is closed


def test_a_failing_clock_never_fails_the_step(monkeypatch, caplog) -> None:
    import torch

    from vllm_piep.runtime.worker.step import _wrap_execute_model, _wrap_sample_tokens

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "Event", broken)

    class Worker:
        device = torch.device("cuda", 0)

    worker = Worker()
    result = Output()
    execute = _wrap_execute_model(lambda self, so: None)
    sample = _wrap_sample_tokens(lambda self, grammar: result)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        assert execute(worker, object()) is None
        assert sample(worker, None) is result
    assert not hasattr(result, STEP_TIME_ATTR)  # the engine times it, and counts it
    assert caplog.text.count("timing a step failed") == 1


def test_the_sampling_wrapper_leaves_nothing_to_run_after_the_wait_on_model_runner_v2(
        cuda_events) -> None:
    """On model runner V2 the step's time is on its output when `sample_tokens` returns, and
    vLLM's own `get_output` is left as it is: nothing of the plugin's runs after the loop's
    wait on the device. Another async output still gets its time when vLLM asks for it."""
    from vllm_piep.runtime.worker.step import _wrap_execute_model, _wrap_sample_tokens

    class Worker:
        device = "cuda"

    for kind in (AsyncOutputV2, AsyncOutput):
        worker, result = Worker(), Output()
        pending = kind(result, time.perf_counter_ns())
        execute = _wrap_execute_model(lambda self, so: None)
        sample = _wrap_sample_tokens(lambda self, grammar: pending)
        assert execute(worker, object()) is None
        STREAM.launch(1_000_000)
        assert sample(worker, None) is pending
        v2 = kind is AsyncOutputV2
        assert ("get_output" in vars(pending)) != v2 and hasattr(result, STEP_TIME_ATTR) == v2
        assert pending.get_output() is result
        step_ns, timer = read_step_time(result)
        assert step_ns is not None and step_ns >= 1_000_000 and timer == "cuda_event"


def test_a_step_read_on_several_threads_at_once_gives_its_events_back_once(
        cuda_events, monkeypatch) -> None:
    """The engine core, the span writer and the pickling of the output may read one step at
    the same time: its two events go back to the pool once, never to two later steps."""
    import threading

    class SlowEvent(FakeCudaEvent):
        def elapsed_time(self, end: FakeCudaEvent) -> float:
            time.sleep(0.01)  # the GIL goes to the other readers meanwhile
            return super().elapsed_time(end)

    import torch

    monkeypatch.setattr(torch.cuda, "Event", SlowEvent)
    clock = CudaStepClock()
    clock.begin()
    STREAM.launch(200_000)
    step = clock.end()
    assert step is not None
    time.sleep(0.001)
    go = threading.Barrier(4)
    read: list[int] = []

    def reader() -> None:
        go.wait()
        read.append(step.ns())

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(read) == 4 and len(set(read)) == 1
    assert len(clock._idle) == 2 and len({id(e) for e in clock._idle}) == 2
