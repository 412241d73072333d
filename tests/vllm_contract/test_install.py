"""Every patch group installs, is idempotent and uninstalls to vLLM's original; and installing
the plugin the way a GPU engine core with an in-process worker does changes nothing else in the
process (the CPU worker's import replaces torch's CUDA and accelerator functions)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from support.paths import environ_with_tests

pytest.importorskip("vllm")

from vllm_piep.runtime import (
    cli,
    install,  # noqa: E402
)
from vllm_piep.runtime.api_server import (
    endpoints,
    outputs,  # noqa: E402
    tenant,
)
from vllm_piep.runtime.engine_core import patch_executor_init, patches
from vllm_piep.runtime.patching import install_all  # noqa: E402
from vllm_piep.runtime.worker import detail, patch_initialize_from_config, step

GROUPS = {"cli": cli.patches, "worker": step.patches, "engine": patches.patches,
          "api": outputs.patches, "endpoints": endpoints.patches, "spans": detail.span_patches,
          "tenant": tenant.patches,
          "in-process worker": lambda: [install._in_process_worker_patch()],
          "detail-collectives": lambda: [dataclasses.replace(p)
                                         for p in detail.collective_patches()],
          **{f"endpoints: {name}": make for name, make in endpoints.OPTIONAL_GROUPS.items()},
          "CPU platform": detail.cpu_eager_pipeline_patches,
          "workers meter themselves": lambda: [patch_executor_init.patch(),
                                               patch_initialize_from_config.patch()]}


@pytest.fixture
def clean_vllm():
    yield
    install.deactivate()


@pytest.mark.parametrize("make", GROUPS.values(), ids=GROUPS.keys())
def test_patch_groups_install_idempotently_and_uninstall(make, clean_vllm) -> None:
    patches = make()
    assert patches, "an empty group tests nothing"
    originals = [p.target.__dict__[p.name] for p in patches]
    assert install_all(patches)
    wrapped = [p.target.__dict__[p.name] for p in patches]
    assert all(p.installed for p in patches) and wrapped != originals
    assert install_all(make())  # a second install (new Patch objects) is a no-op
    assert [p.target.__dict__[p.name] for p in patches] == wrapped
    for p in make():
        p.uninstall()
    assert [p.target.__dict__[p.name] for p in patches] == originals
    # staticmethod/classmethod kinds survive the round trip
    assert [type(o) for o in originals] == [type(p.target.__dict__[p.name]) for p in patches]


# Installs the plugin as an engine core does (vLLM names the process "EngineCore_DP0" and calls
# every general plugin's register()), then the worker side as UniProcExecutor._init_executor's
# patch does, plus detail mode's collectives; prints what changed. The vLLM modules the patches
# wrap are imported first, on this machine's CPU platform (on a CPU, vLLM's GPU modules import
# only so): what is imported or replaced afterwards is the plugin's doing.
_ENGINE_CORE = r"""
import json, multiprocessing, os, sys
import torch
multiprocessing.current_process().name = "EngineCore_DP0"
os.environ["PIEP_ENABLED"] = "1"
import vllm.v1.worker.gpu_worker, vllm.v1.core.sched.scheduler
import vllm.v1.executor.uniproc_executor, vllm.distributed.parallel_state
assert not [m for m in sys.modules if m.startswith("vllm.v1.worker.cpu")]
from support.torch_state import replaced, watched
before = watched()
import vllm.platforms
from vllm.platforms.interface import Platform, PlatformEnum
if sys.argv[1] == "cuda":
    class ReportedCuda(Platform):  # vllm.platforms.cuda needs vLLM's compiled CUDA kernels
        _enum = PlatformEnum.CUDA
        device_name = device_type = "cuda"
        dispatch_key = "CUDA"
    vllm.platforms.current_platform = ReportedCuda()
assert vllm.platforms.current_platform.is_cpu() == (sys.argv[1] == "cpu")
from vllm_piep.plugin import register
from vllm_piep.runtime import install
from vllm_piep.runtime.worker import detail
from vllm_piep.runtime.patching import install_all
register()
install._install_worker_side()
install_all(detail.collective_patches())
print(json.dumps({
    "installed": sum(p.installed for p in install.runtime_patches()),
    "cpu_modules": sorted(m for m in sys.modules if m.startswith("vllm.v1.worker.cpu")),
    "replaced": replaced(before),
}))
"""


def _engine_core(platform: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _ENGINE_CORE, platform], capture_output=True,
                         text=True, timeout=600, env=environ_with_tests())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_gpu_engine_core_with_an_in_process_worker_keeps_torch_as_it_was() -> None:
    gpu = _engine_core("cuda")
    assert gpu["installed"] > 0
    assert gpu["cpu_modules"] == [] and gpu["replaced"] == []


def test_on_the_cpu_platform_the_cpu_worker_patch_is_installed() -> None:
    """The other side of the rule: on CPU the CPU worker's patch is installed (and its import
    is what the GPU test above would catch)."""
    cpu = _engine_core("cpu")
    assert "vllm.v1.worker.cpu_worker" in cpu["cpu_modules"]
