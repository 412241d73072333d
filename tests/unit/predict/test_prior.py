"""The analytic prior and its device profiles."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vllm_piep.model.components import INDEX, STATIC
from vllm_piep.model.devices import (
    GPU_SPECS,
    DeviceProfile,
    GpuFacts,
    UnknownDevice,
    cpu_spec,
    generic_gpu_spec,
    resolve_spec,
)
from vllm_piep.model.flops import ModelShape, StepBatch, step_work
from vllm_piep.predict.attribution import split_step
from vllm_piep.predict.base import Predictor, StepInput
from vllm_piep.predict.prior import PriorPredictor

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
    assert energy.joules[STATIC] == pytest.approx(prof.static_watts * 1 * 0.02)
    assert energy.joules[INDEX["sync_wait"]] == 0


def test_static_power_counts_every_gpu_rank_but_one_cpu() -> None:
    step = decode_step(2, seconds=0.5)
    tp4 = prior(replace(SHAPE, tp=4)).predict_step(step)
    assert tp4.joules[STATIC] == pytest.approx(4 * prior().profile.static_watts * 0.5)
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


# Device names exactly as CUDA (`torch.cuda.get_device_name`) and NVML (`nvidia-smi
# --query-gpu=name`) report them, as pasted in public issue threads and logs (docs/devices.md
# lists where each was seen), and the profile each must get.
REPORTED_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100-sxm5-80gb",
    "NVIDIA H100 PCIe": "h100-pcie-80gb",
    "NVIDIA H100 NVL": "h100-nvl-94gb",
    "NVIDIA H200": "h200-sxm-141gb",
    "NVIDIA H200 NVL": "h200-nvl-141gb",
    "NVIDIA GH200 480GB": "gh200-96gb",
    "NVIDIA GH200 144G HBM3e": "gh200-144gb",
    "NVIDIA B200": "b200",
    "NVIDIA GB200": "gb200",
    "NVIDIA A100-SXM4-40GB": "a100-sxm4-40gb",
    "A100-SXM4-40GB": "a100-sxm4-40gb",  # drivers before R470 drop the "NVIDIA " prefix
    "NVIDIA A100-SXM4-80GB": "a100-sxm4-80gb",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "NVIDIA L40S": "l40s",
    "NVIDIA L40": "l40",
    "NVIDIA L4": "l4",
    "NVIDIA A10G": "a10g",
    "NVIDIA A10": "a10",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "NVIDIA RTX 6000 Ada Generation": "rtx-6000-ada",
    "NVIDIA RTX A6000": "rtx-a6000",
    "Tesla V100-SXM2-16GB": "v100-sxm2",
    "Tesla V100-SXM2-32GB": "v100-sxm2",
    "Tesla V100-PCIE-16GB": "v100-pcie",
    "Tesla T4": "t4",
    "AMD Instinct MI300X": "mi300x",
    "AMD Instinct MI325X": "mi325x",
    # A MIG instance is named after its GPU; the profile is the GPU's.
    "NVIDIA A100-SXM4-40GB MIG 1g.5gb": "a100-sxm4-40gb",
    "NVIDIA H100 80GB HBM3 MIG 3g.40gb": "h100-sxm5-80gb",
}


@pytest.mark.parametrize(("device_name", "expected"), REPORTED_NAMES.items(),
                         ids=REPORTED_NAMES.keys())
def test_reported_gpu_names_resolve_to_their_own_profile(device_name: str,
                                                         expected: str) -> None:
    assert resolve_spec("auto", "cuda", device_name).name == expected


def test_every_profile_is_reachable_from_a_reported_name_and_names_its_source() -> None:
    assert set(REPORTED_NAMES.values()) == set(GPU_SPECS)
    for spec in GPU_SPECS.values():
        assert any(doc in spec.source for doc in ("datasheet", "data sheet", "whitepaper",
                                                  "documentation")), spec.name
        assert 0 < spec.static_watts < spec.tdp_watts
        assert spec.peak_flops_16bit > spec.peak_flops_fp32 > 0


def test_unknown_devices_and_profiles_are_refused_clearly() -> None:
    with pytest.raises(UnknownDevice, match="no device profile.*device_profile"):
        resolve_spec("auto", "cuda", "NVIDIA GeForce GT 710")
    with pytest.raises(ValueError, match="unknown device profile 'a200'.*a100-sxm4-40gb"):
        resolve_spec("a200", "cuda", None)
    assert resolve_spec("l4", "cpu", None).name == "l4"  # an explicit choice wins


# What NVML reports for three GPUs that have datasheet profiles (power limit mW, memory bus
# bits, max memory and SM clocks MHz, CUDA cores, compute capability): a generic profile built
# from it must land near the datasheet one.
NVML_FACTS = {
    "a100-sxm4-40gb": GpuFacts("NVIDIA A100-SXM4-40GB", 400, 5120, 1215, 1410, 6912, (8, 0),
                               (4, 16)),
    "h100-sxm5-80gb": GpuFacts("NVIDIA H100 80GB HBM3", 700, 5120, 2619, 1980, 16896, (9, 0),
                               (5, 16)),
    "l4": GpuFacts("NVIDIA L4", 72, 192, 6251, 2040, 7424, (8, 9), (4, 16)),
    "rtx-4090": GpuFacts("NVIDIA GeForce RTX 4090", 450, 384, 10501, 2520, 16384, (8, 9),
                         (4, 16)),
}


@pytest.mark.parametrize("key", NVML_FACTS)
def test_generic_profile_from_nvml_is_close_to_the_datasheet(key: str) -> None:
    generic, datasheet = generic_gpu_spec(NVML_FACTS[key]), GPU_SPECS[key]
    assert generic.name == f"generic/{NVML_FACTS[key].name}"
    for field in ("tdp_watts", "mem_bandwidth", "peak_flops_fp32"):
        assert getattr(generic, field) == pytest.approx(getattr(datasheet, field), rel=0.02)
    # Boost clocks above the datasheet's tensor clock: within 10 %.
    assert generic.peak_flops_16bit == pytest.approx(datasheet.peak_flops_16bit, rel=0.1)
    assert "median" not in generic.source


def test_generic_profile_without_nvml_says_which_figures_are_medians() -> None:
    spec = generic_gpu_spec(GpuFacts("NVIDIA H20"))
    assert spec.name == "generic/NVIDIA H20"
    assert spec.tdp_watts == pytest.approx(float(np.median([s.tdp_watts
                                                            for s in GPU_SPECS.values()])))
    assert "median of the known profiles for: board power, memory bandwidth" in spec.source


def test_cpu_spec_reads_vector_width_and_clock() -> None:
    avx512 = cpu_spec(cores=4, cpuinfo={"flags": "fma avx2 avx512f", "cpu MHz": "3000",
                                        "model name": "Test CPU"})
    avx2 = cpu_spec(cores=4, cpuinfo={"flags": "fma avx2", "cpu MHz": "3000"})
    assert avx512.peak_flops_fp32 == 2 * avx2.peak_flops_fp32 == 4 * 3e9 * 64
    assert avx512.name == "cpu-avx512-4c" and "Test CPU" in avx512.source
    assert avx512.tdp_watts == 40 and avx512.static_watts == pytest.approx(12)
    assert not avx512.one_device_per_rank
