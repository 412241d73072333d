"""The NVML meter meters this instance's GPUs only: CUDA ordinals found in NVML by
CUDA_VISIBLE_DEVICES (indices, UUIDs, abbreviated UUIDs, MIG UUIDs) or by the CUDA device's own
UUID / PCI address, MIG instances metered as their whole GPU, once. Against the stand-in
`pynvml` (tests/support/fake_pynvml.py)."""

from __future__ import annotations

import logging

import pytest
from support.fake_pynvml import FakeGpu, FakeNvml

from vllm_piep.meters.common import MeterError
from vllm_piep.meters.gpus import CudaIdentity, gpu_facts, instance_gpus
from vllm_piep.meters.nvml import NvmlMeter
from vllm_piep.model.devices import generic_gpu_spec
from vllm_piep.runtime.api_server.meter_sampler import meter_factory


def host(n: int = 4, **kw) -> FakeNvml:
    return FakeNvml([FakeGpu(power_w=100.0 * (i + 1), **kw) for i in range(n)])


def indices(nvml: FakeNvml, ordinals=None, env=None, identities=None) -> list[int]:
    nvml.nvmlInit()
    return [g.index for g in instance_gpus(nvml, ordinals, identities, env or {})]


def test_without_cuda_visible_devices_the_ordinals_are_the_gpus() -> None:
    nvml = host()
    assert indices(nvml, [0]) == [0]
    assert indices(nvml, [0, 1]) == [0, 1]
    assert indices(nvml) == [0, 1, 2, 3]  # every GPU CUDA sees


def test_cuda_visible_devices_integers_select_physical_gpus() -> None:
    nvml = host()
    env = {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert indices(nvml, [0, 1], env) == [2, 3]
    assert indices(nvml, None, env) == [2, 3]
    with pytest.raises(MeterError, match=r"CUDA device 2 is not visible .*'2,3'"):
        indices(nvml, [2], env)


def test_cuda_visible_devices_uuids_full_and_abbreviated_in_any_order() -> None:
    nvml = host()
    uuids = [g.uuid for g in nvml.gpus]
    env = {"CUDA_VISIBLE_DEVICES": f"{uuids[3]},{uuids[1][:12]}"}
    assert indices(nvml, [0, 1], env) == [3, 1]
    with pytest.raises(MeterError, match="more than one GPU"):
        indices(nvml, [0], {"CUDA_VISIBLE_DEVICES": "GPU-0000"})


def test_the_cuda_devices_identity_wins_over_the_environment() -> None:
    nvml = host()
    by_uuid = CudaIdentity(nvml.gpus[2].uuid.removeprefix("GPU-"), None)
    by_pci = CudaIdentity(None, (0, nvml.gpus[1].pci_bus, 0))
    env = {"CUDA_VISIBLE_DEVICES": "0,3"}
    assert indices(nvml, [0, 1], env, {0: by_uuid, 1: by_pci}) == [2, 1]


def test_mig_instances_meter_their_whole_gpu_once_and_say_so() -> None:
    gpus = [FakeGpu(power_w=300.0, mig_uuids=["MIG-aaaa-1", "MIG-aaaa-2"]),
            FakeGpu(power_w=100.0)]
    nvml = FakeNvml(gpus)
    env = {"CUDA_VISIBLE_DEVICES": "MIG-aaaa-1,MIG-aaaa-2"}
    meter = NvmlMeter(nvml=nvml, detect_s=0.01, cuda_devices=[0, 1], environ=env)
    assert meter.indices == [0]  # two instances, one GPU
    (device,) = meter.devices()
    assert device.name == "gpu0" and "whole GPU" in device.note
    assert "MIG-aaaa-1" in device.note and "MIG-aaaa-2" in device.note
    meter.start()
    meter.read()  # the parent's counter: a MIG handle would read none
    meter.stop()
    # Selected by index, a GPU in MIG mode is labelled too.
    nvml.nvmlInit()
    (gpu,) = instance_gpus(nvml, [0], environ={})
    assert gpu.mig == ("MIG mode",)


def test_meter_reads_only_the_instance_gpus() -> None:
    nvml = host()
    meter = NvmlMeter(nvml=nvml, detect_s=0.01, cuda_devices=[0],
                      environ={"CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    meter.start()
    reading = meter.read()
    meter.stop()
    assert list(reading.joules) == ["gpu3"]
    assert [d.note for d in meter.devices()] == [f"cuda:0 = {nvml.gpus[3].uuid}"]


def test_integer_indices_on_a_mixed_host_warn_about_cuda_order(caplog) -> None:
    nvml = FakeNvml([FakeGpu(name="NVIDIA H100 80GB HBM3"), FakeGpu(name="NVIDIA L4")])
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        indices(nvml, [0], {"CUDA_VISIBLE_DEVICES": "1"})
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        indices(nvml, [0], {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert caplog.text == ""


def test_serve_meter_factory_meters_the_instance_devices(monkeypatch) -> None:
    nvml = host()
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2,3")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    factory, label = meter_factory("nvml", cuda_devices=2)
    meter = factory()
    assert label == "nvml" and meter.indices == [1, 2]
    meter.stop()


def test_generic_profile_from_the_stand_in_nvml() -> None:
    nvml = FakeNvml([FakeGpu(name="NVIDIA H20", power_limit_mw=500_000, cuda_cores=16896,
                             compute_capability=(9, 0), sm_clock_mhz=1980, mem_bus_bits=6144,
                             mem_clock_mhz=2619)])
    nvml.nvmlInit()
    (gpu,) = instance_gpus(nvml, [0], environ={})
    spec = generic_gpu_spec(gpu_facts(nvml, gpu))
    assert spec.name == "generic/NVIDIA H20" and spec.tdp_watts == 500
    assert spec.mem_bandwidth == pytest.approx(6144 / 8 * 2619e6 * 2)
    assert "median of the known profiles" not in spec.source


def test_a_gpu_without_a_profile_gets_a_generic_one_and_one_warning(caplog) -> None:
    from vllm_piep.predict.loader import device_spec

    nvml = FakeNvml([FakeGpu(name="NVIDIA H20", power_limit_mw=500_000)])

    def facts():
        nvml.nvmlInit()
        return gpu_facts(nvml, instance_gpus(nvml, [0], environ={})[0])

    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        spec = device_spec("auto", "cuda", "NVIDIA H20", facts)
    assert spec.name == "generic/NVIDIA H20" and spec.tdp_watts == 500
    assert caplog.text.count("no device profile for cuda device 'NVIDIA H20'") == 1
    assert "pricing with generic/NVIDIA H20" in caplog.text

    def broken():
        raise MeterError("nvml: NVML is not usable here")

    # NVML failing too (or a device vLLM could not name): still energy, from the medians.
    assert device_spec("auto", "cuda", None, broken).name == "generic/unknown cuda device"
