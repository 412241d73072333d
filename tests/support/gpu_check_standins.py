"""The GPU check's dry run (`scripts/gpu_check.py --dry-run`): a backend that runs every section
on this machine's CPU, with stand-ins where the real libraries sit: the `pynvml` module of
`standin_pynvml/` (found first on PYTHONPATH), and `fake_cuda`'s events and simulated stream at
`torch.cuda.Event` / `torch.cuda.current_stream`, on which the step clock's work is launched.
Sizes are small (`DRY_SCALE`), models tiny (`models.json`'s `dry` configs)."""

from __future__ import annotations

import sys
import time
from typing import Any

import fake_cuda
import pynvml
import torch
from fake_cuda import STREAM, FakeCudaEvent, install_fake_cuda_events

from vllm_piep.meters.gpus import CudaIdentity
from vllm_piep.tools.gpu_check.backend import Backend, Scale

# profiled_steps: a CPU op's time in the trace is wall time, so the kernels section profiles
# enough steps that one preemption of a busy machine inside an op outside the tree cannot move
# the share placed in a module by more than a point or two.
DRY_SCALE = Scale(load_s=0.8, settle_s=0.2, idle_s=0.3, command_s=0.5, window_s=0.25,
                  window_periods=10, clock_steps_ms=(1.0, 10.0, 30.0), clock_repeats=5,
                  queued_steps=50, host_cost_steps=500, matmul_n=128, burn_n=64,
                  prefill=((1, 256), (4, 64)), decode_batches=(1, 8), decode_context=64,
                  decode_positions=32, requests=24, arrival_every=8,
                  prompt_tokens=(16, 24, 32), output_tokens=(20, 30, 40), profiled_steps=12,
                  profiled_batch=32)


class SimulatedBurner:
    """Work of `op_s` per op launched on the simulated stream: the host runs ahead of it as it
    does of a GPU."""

    op_s = 50e-6

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def run(self, ops: int) -> None:
        STREAM.launch(int(ops * self.op_s * 1e9))

    def ops_for(self, seconds: float) -> int:
        return max(1, round(seconds / self.op_s))


class StandinBackend(Backend):
    dry_run = True
    device = "cpu"
    model_variant = "dry"
    scale = DRY_SCALE

    def __init__(self) -> None:
        install_fake_cuda_events()
        fake_cuda.log = lambda record: None

    @property
    def dtype(self) -> Any:
        return torch.float32

    def sync(self) -> None:
        """Waits for the simulated stream, as `torch.cuda.synchronize` waits for the GPU."""
        STREAM.release()
        wait = STREAM.point() - time.perf_counter_ns()
        if wait > 0:
            time.sleep(wait / 1e9)

    def event(self) -> Any:
        return FakeCudaEvent(enable_timing=True)

    def burner(self, n: int) -> Any:
        return SimulatedBurner(self)

    def identity(self, ordinal: int) -> CudaIdentity:
        gpu = pynvml._NVML.gpus[ordinal]  # noqa: SLF001  (the stand-in's own GPU)
        return CudaIdentity(gpu.uuid.removeprefix("GPU-"), (0, gpu.pci_bus, 0))

    def free_memory(self) -> int:
        return 16 * 2**30

    def torch_facts(self) -> dict[str, Any]:
        gpu = pynvml._NVML.gpus[0]  # noqa: SLF001
        return {"name": gpu.name, "memory_bytes": gpu.memory_bytes, "capability": "8.0",
                "uuid": gpu.uuid, "cuda": None, "stand_in": True}

    def matmul_command(self, seconds: float) -> list[str]:
        code = ("import time, torch\na = torch.randn(128, 128)\nt = time.monotonic()\n"
                f"while time.monotonic() - t < {seconds}:\n    a @ a\n")
        return [sys.executable, "-c", code]
