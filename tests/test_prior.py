"""The analytic prior and its device profiles."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vllm_piep.components import INDEX, STATIC
from vllm_piep.flops import ModelShape, StepBatch, step_work
from vllm_piep.predict.attribution import split_step
from vllm_piep.predict.base import Predictor, StepInput
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.predict.profiles import GPU_SPECS, DeviceProfile, cpu_spec, resolve_spec

SHAPE = ModelShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                   head_dim=128, vocab=128256, dtype_bytes=2)


def prior(shape: ModelShape = SHAPE, profile: str = "a100-sxm4-40gb") -> PriorPredictor:
    return PriorPredictor(shape, DeviceProfile.from_spec(GPU_SPECS[profile], shape.dtype_bytes))


def decode_step(n: int, context: int = 100, seconds: float = 0.02) -> StepInput:
    return StepInput(StepBatch.from_lists([0] * n, [1] * n, [context] * n, [1] * n), seconds)


def test_prior_is_a_predictor() -> None:
    p = prior()
    assert isinstance(p, Predictor)
    assert p.source == "prior" and p.bundle_id == "prior/a100-sxm4-40gb"


def test_energy_is_the_roofline_sum() -> None:
    p = prior()
    step = decode_step(4)
    energy = p.predict_step(step)
    work = step_work(SHAPE, step.batch)
    prof = p.profile
    expected = (prof.joules_per_flop * work.flops + prof.joules_per_byte * work.mem_bytes
                + prof.joules_per_link_byte * work.link_bytes).sum(axis=0)
    np.testing.assert_allclose(np.delete(energy.joules, STATIC), np.delete(expected, STATIC))
    assert energy.joules[STATIC] == pytest.approx(60 * 1 * 0.02)
    assert energy.joules[INDEX["sync_wait"]] == 0


def test_static_power_counts_every_gpu_rank_but_one_cpu() -> None:
    step = decode_step(2, seconds=0.5)
    tp4 = prior(replace(SHAPE, tp=4)).predict_step(step)
    assert tp4.joules[STATIC] == pytest.approx(4 * 60 * 0.5)
    assert tp4.joules[INDEX["allreduce"]] > 0 and tp4.joules[INDEX["allgather"]] > 0
    cpu = PriorPredictor(replace(SHAPE, tp=2, dtype_bytes=4),
                         DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    assert cpu.predict_step(step).joules[STATIC] == pytest.approx(cpu.profile.static_watts * 0.5)


def test_more_tokens_cost_more_and_split_follows_work() -> None:
    p = prior()
    small = p.predict_step(decode_step(1)).joules.sum()
    big = p.predict_step(decode_step(32)).joules.sum()
    assert big > small
    step = StepInput(StepBatch.from_lists([512, 0], [0, 1], [0, 50], [1, 1]), 0.05)
    per_request = split_step(p.predict_step(step))
    dynamic = np.delete(per_request, STATIC, axis=1).sum(axis=1)
    assert dynamic[0] > 10 * dynamic[1]  # the prefill did far more work
    # Static energy by time share: both requests held the device for the whole step.
    assert per_request[0, STATIC] == pytest.approx(per_request[1, STATIC], rel=1e-12)
    assert per_request[0, INDEX["logits"]] == pytest.approx(per_request[1, INDEX["logits"]])


def test_h100_is_more_efficient_per_flop_than_a100() -> None:
    a100 = DeviceProfile.from_spec(GPU_SPECS["a100-sxm4-40gb"], 2)
    h100 = DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], 2)
    assert h100.joules_per_flop < a100.joules_per_flop
    fp32 = DeviceProfile.from_spec(GPU_SPECS["a100-sxm4-40gb"], 4)
    assert fp32.joules_per_flop > a100.joules_per_flop  # FP32 runs off the tensor cores


@pytest.mark.parametrize(("device_name", "expected"), [
    ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb"), ("NVIDIA A100 80GB PCIe", "a100-sxm4-80gb"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm5-80gb"), ("NVIDIA L4", "l4")])
def test_gpu_names_resolve(device_name: str, expected: str) -> None:
    assert resolve_spec("auto", "cuda", device_name).name == expected


def test_unknown_devices_and_profiles_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="no device profile.*device_profile"):
        resolve_spec("auto", "cuda", "NVIDIA GeForce GT 710")
    with pytest.raises(ValueError, match="unknown device profile 'a200'.*a100-sxm4-40gb"):
        resolve_spec("a200", "cuda", None)
    assert resolve_spec("l4", "cpu", None).name == "l4"  # an explicit choice wins


def test_cpu_spec_reads_vector_width_and_clock() -> None:
    avx512 = cpu_spec(cores=4, cpuinfo={"flags": "fma avx2 avx512f", "cpu MHz": "3000",
                                        "model name": "Test CPU"})
    avx2 = cpu_spec(cores=4, cpuinfo={"flags": "fma avx2", "cpu MHz": "3000"})
    assert avx512.peak_flops_fp32 == 2 * avx2.peak_flops_fp32 == 4 * 3e9 * 64
    assert avx512.name == "cpu-avx512-4c" and "Test CPU" in avx512.source
    assert avx512.tdp_watts == 40 and avx512.static_watts == pytest.approx(12)
    assert not avx512.one_device_per_rank
