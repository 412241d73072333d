"""Where the check runs: the torch device, its clock and sizes. `CudaBackend` is the real GPU;
a dry run's backend (tests/support/gpu_check_standins.py) runs the same code on the CPU."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_piep.meters.gpus import CudaIdentity
from vllm_piep.tools.gpu_check.report import SectionSkipped


@dataclass(frozen=True)
class Scale:
    """How long and how big each measurement is."""

    load_s: float = 4.0  # the NVML section's matmul load (compared over its last 3 s)
    settle_s: float = 1.0  # the first part of a load, left out (power readings lag)
    idle_s: float = 2.0  # idle power window
    command_s: float = 5.0  # the matmul command `python -m vllm_piep.meters` measures
    window_s: float = 3.0  # the prior's windows: at least this long...
    window_periods: int = 20  # ...and this many counter updates
    clock_steps_ms: tuple[float, ...] = (1.0, 10.0, 100.0)
    clock_repeats: int = 5  # synchronized steps of each length
    queued_steps: int = 50
    host_cost_steps: int = 2000
    matmul_n: int = 8192  # the load's square matmul
    burn_n: int = 4096  # the step clock's work unit
    prefill: tuple[tuple[int, int], ...] = ((1, 2048), (8, 512))  # (requests, tokens each)
    decode_batches: tuple[int, ...] = (1, 16, 64, 128)
    decode_context: int = 1024
    decode_positions: int = 256  # static-cache positions after the context
    requests: int = 24  # measured mode's staggered requests
    arrival_every: int = 8  # steps between two arrivals
    prompt_tokens: tuple[int, ...] = (128, 160, 192, 224, 256, 96, 320, 64)
    output_tokens: tuple[int, ...] = (60, 70, 80, 90, 100, 110)
    profiled_steps: int = 4  # decode steps under torch.profiler
    profiled_batch: int = 16


class Backend:
    """The device the sections use. Subclasses say how to reach it."""

    dry_run = False
    device = "cuda"
    scale = Scale()
    model_variant = "real"  # which configs `models.py` builds

    @property
    def dtype(self) -> Any:
        import torch

        return torch.bfloat16

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize()

    def event(self) -> Any:
        import torch

        return torch.cuda.Event(enable_timing=True)

    def burner(self, n: int) -> Burner:
        """Work of a known length per op: `n`×`n` matmuls."""
        return TorchBurner(self, n)

    def identity(self, ordinal: int) -> CudaIdentity:
        return CudaIdentity.of_torch(ordinal)

    def free_memory(self) -> int:
        import torch

        return int(torch.cuda.mem_get_info()[0])

    def torch_facts(self) -> dict[str, Any]:
        import torch

        props = torch.cuda.get_device_properties(0)
        return {"name": props.name, "multiprocessors": props.multi_processor_count,
                "memory_bytes": props.total_memory,
                "capability": f"{props.major}.{props.minor}",
                "l2_bytes": getattr(props, "L2_cache_size", None),
                "uuid": str(getattr(props, "uuid", "")), "cuda": torch.version.cuda,
                "hip": getattr(torch.version, "hip", None)}

    def matmul_command(self, seconds: float) -> list[str]:
        """A command that loads the GPU with matmuls for `seconds`."""
        n = self.scale.matmul_n
        code = (f"import time, torch\na = torch.randn({n}, {n}, device='{self.device}', "
                f"dtype=torch.bfloat16)\ntorch.cuda.synchronize()\nt = time.monotonic()\n"
                f"while time.monotonic() - t < {seconds}:\n    a @ a\n"
                "torch.cuda.synchronize()\n")
        return [sys.executable, "-c", code]


class Burner(Protocol):
    """Device work in units of `op_s` seconds."""

    backend: Backend
    op_s: float

    def run(self, ops: int) -> None: ...

    def ops_for(self, seconds: float) -> int: ...


class TorchBurner:
    """`n`×`n` matmuls on the backend's device, their length timed once by a burst."""

    def __init__(self, backend: Backend, n: int, burst: int = 20) -> None:
        import torch

        self.backend = backend
        self.a = torch.randn(n, n, device=backend.device, dtype=backend.dtype)
        self.out = torch.empty_like(self.a)
        self.run(3)
        start, end = backend.event(), backend.event()
        backend.sync()
        start.record()
        self.run(burst)
        end.record()
        backend.sync()
        self.op_s = max(start.elapsed_time(end) / 1e3 / burst, 1e-7)

    def run(self, ops: int) -> None:
        import torch

        for _ in range(ops):
            torch.mm(self.a, self.a, out=self.out)

    def ops_for(self, seconds: float) -> int:
        return max(1, round(seconds / self.op_s))


class CudaBackend(Backend):
    """CUDA device 0 of this process (ROCm's HIP devices too: torch calls both `cuda`)."""

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise SectionSkipped("no CUDA GPU here (torch.cuda.is_available() is False)")
