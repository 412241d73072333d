"""The detail-mode ranges on a Hugging Face Llama: `torch.profiler.record_function` ranges
named by `vllm_piep.spans.records.module_range_name(type, node)`, opened in forward pre-hooks
and closed in forward hooks, with the node ids and types of `model.tree` (`embedding`, `layers.{i}`,
`layers.{i}.self_attn`, `layers.{i}.mlp`, `layers.{i}.input_layernorm`, ..., `final_norm`,
`logits`)."""

from __future__ import annotations

from pathlib import Path

from torch import nn
from torch.profiler import record_function

from vllm_piep.spans.records import module_range_name, step_range_name


def llama_nodes(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(module, type, node id) of every node of an HF `LlamaForCausalLM`."""
    inner = model.model
    nodes = [(inner.embed_tokens, "embedding", "embedding")]
    for i, layer in enumerate(inner.layers):
        nodes.append((layer, "layer", f"layers.{i}"))
        nodes.append((layer.input_layernorm, "norm", f"layers.{i}.input_layernorm"))
        nodes.append((layer.self_attn, "attention", f"layers.{i}.self_attn"))
        nodes.append((layer.post_attention_layernorm, "norm",
                      f"layers.{i}.post_attention_layernorm"))
        nodes.append((layer.mlp, "mlp", f"layers.{i}.mlp"))
    nodes.append((inner.norm, "final_norm", "final_norm"))
    nodes.append((model.lm_head, "logits", "logits"))
    return nodes


def annotate(nodes: list[tuple[nn.Module, str, str]]) -> list:
    """Hooks that open and close each node's range; returns the handles (call `.remove()`)."""
    handles = []
    for module, node_type, node in nodes:
        name = module_range_name(node_type, node)
        open_ranges: list[record_function] = []

        def pre(_module, _args, name=name, open_ranges=open_ranges):
            rf = record_function(name)
            rf.__enter__()
            open_ranges.append(rf)

        def post(_module, _args, _output, open_ranges=open_ranges):
            open_ranges.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return handles


def profile_forward(model_dir: Path, out: Path, tokens: int = 12, record_shapes: bool = False,
                    seed: int | None = None) -> list[tuple[nn.Module, str, str]]:
    """One forward pass of the HF Llama in `model_dir` under torch.profiler (one process, no
    torch.distributed: the trace names no rank), inside step 0's range with every node's range;
    writes the Chrome trace to `out` and returns the nodes."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    nodes = llama_nodes(model)
    handles = annotate(nodes)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    try:
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU],
                                      record_shapes=record_shapes) as prof, \
                record_function(step_range_name(0)):
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    prof.export_chrome_trace(str(out))
    return nodes
