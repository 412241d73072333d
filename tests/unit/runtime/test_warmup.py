"""One-off work inside a step is not the request's cost (`runtime/engine_core/warmup.py`): the
rule, the energy it moves to the `warmup` outcome, and the first steps judged afterwards."""

from __future__ import annotations

import pytest

from vllm_piep.model.devices import DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape, StepBatch
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.warmup import WarmupDetector

SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=4)
DECODE = StepBatch.from_lists([0], [1], [10], [1])
PREFILL = StepBatch.from_lists([10], [0], [0], [1])


def test_the_rule() -> None:
    detector = WarmupDetector()
    assert not detector.ready
    for _ in range(8):
        detector.observe(1, 0.02)  # decode steps of 20 ms
    detector.observe(500, 0.2)  # a 500-token prefill at 2500 tokens/s
    assert detector.ready
    assert detector.excess_s(1, 0.03) == 0.0  # a slow-ish decode: not warm-up
    assert detector.excess_s(1, 2.4) == pytest.approx(2.4 - 0.02)  # the first logprobs step
    # A long prefill is compared with the best token rate, not with a decode step.
    assert detector.excess_s(1000, 0.45) == 0.0
    assert detector.excess_s(1000, 5.0) == pytest.approx(5.0 - 0.4)
    # Tiny absolute excesses are noise, whatever the ratio.
    fast = WarmupDetector()
    for _ in range(8):
        fast.observe(1, 0.001)
    assert fast.excess_s(1, 0.05) == 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def accountant() -> EngineAccountant:
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    return EngineAccountant(lambda: prior, clock_ns=Clock())


def step(acc: EngineAccountant, key: int, ids: list[str], batch: StepBatch, ns: int) -> None:
    acc.on_schedule(key, ids, batch)
    acc.on_step_done(key, ns, "perf_counter")


def test_a_slow_step_once_the_history_allows_bills_its_excess_to_warmup() -> None:
    acc = accountant()
    for key in range(8):
        step(acc, key, ["warm"], DECODE, 20_000_000)
    step(acc, 8, ["a", "b"], StepBatch.from_lists([10, 10], [0, 0], [0, 0], [1, 1]),
         6_000_000_000)  # 6 s: the first use of something
    static_w = acc.predictor.profile.static_watts
    # Expected: 20 tokens at the best rate seen (50 tokens/s) = 0.4 s; 5.6 s of static power
    # went to warm-up, not to a or b.
    assert acc.warmup_joules == pytest.approx(static_w * 5.6, rel=1e-6)
    for req in ("a", "b"):
        record = acc.record(req)
        assert record.components[-1] == pytest.approx(static_w * 0.4 / 2, rel=1e-6)
        assert record.prefill_joules + record.decode_joules == pytest.approx(record.joules)
    carried = sum(acc.record(r).joules for r in ("warm", "a", "b"))
    assert carried + acc.warmup_joules == pytest.approx(acc.total_joules, rel=1e-12)
    assert acc.header().warmup_joules == pytest.approx(acc.warmup_joules)


def test_the_first_steps_are_judged_once_eight_have_run() -> None:
    acc = accountant()
    step(acc, 0, ["first"], PREFILL, 2_400_000_000)  # a fresh server's first step: 2.4 s
    for key in range(1, 8):
        step(acc, key, ["first"], DECODE, 20_000_000)
    static_w = acc.predictor.profile.static_watts
    # Its 10 tokens at the best rate seen (50 tokens/s): 0.2 s expected, 2.2 s of warm-up.
    assert acc.warmup_joules == pytest.approx(static_w * 2.2, rel=1e-6)
    record = acc.record("first")
    assert record.components[-1] == pytest.approx(static_w * (0.2 + 7 * 0.02), rel=1e-6)
    assert record.joules + acc.warmup_joules == pytest.approx(acc.total_joules, rel=1e-12)


def test_a_request_gone_before_the_judgement_keeps_its_share() -> None:
    acc = accountant()
    step(acc, 0, ["short"], PREFILL, 2_400_000_000)
    acc.encode(["short"])
    acc.release("short", aborted=False)  # a one-step request: its response went out
    for key in range(1, 8):
        step(acc, key, ["next"], DECODE, 20_000_000)
    assert acc.warmup_joules == 0.0
