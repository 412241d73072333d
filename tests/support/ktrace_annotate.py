"""One forward pass of a Hugging Face Llama under torch.profiler with the detail-mode ranges
(`vllm_piep.tools.hf_tree`) around its step and every node of its model tree."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from vllm_piep.tools.hf_tree import module_ranges, step_range


def profile_forward(model_dir: Path, out: Path, tokens: int = 12, record_shapes: bool = False,
                    seed: int | None = None) -> list[tuple[nn.Module, str, str]]:
    """One forward pass of the HF Llama in `model_dir` under torch.profiler (one process, no
    torch.distributed: the trace names no rank), inside step 0's range with every node's range;
    writes the Chrome trace to `out` and returns the nodes as (module, type, node id)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    with torch.no_grad(), module_ranges(model) as nodes, \
            profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as prof, \
            step_range(0):
        model(ids)
    prof.export_chrome_trace(str(out))
    return [(module, kind, node) for node, kind, module in nodes]
