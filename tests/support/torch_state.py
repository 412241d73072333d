"""The process-wide torch functions that importing vLLM's CPU worker replaces
(`vllm.v1.worker.cpu.shm`): a GPU engine core running its worker in-process must keep them.
`replaced(before)` names those that changed since `before = watched()`."""

from __future__ import annotations

import torch


def watched() -> dict[str, object]:
    return {
        "torch.cuda.Event": torch.cuda.Event,
        "torch.cuda.Stream": torch.cuda.Stream,
        "torch.accelerator.get_memory_info": torch.accelerator.get_memory_info,
        "torch.accelerator.synchronize": torch.accelerator.synchronize,
        "torch.Tensor.pin_memory": torch.Tensor.pin_memory,
        "torch.Tensor.record_stream": torch.Tensor.record_stream,
    }


def replaced(before: dict[str, object]) -> list[str]:
    return sorted(k for k, now in watched().items() if now is not before[k])
