"""The detail-mode ranges on a Hugging Face Llama: `torch.profiler.record_function` ranges
named by `vllm_piep.spans.records.module_range_name(type, node)`, opened in forward pre-hooks
and closed in forward hooks, with the node ids and types of `model.tree` (`embedding`, `layers.{i}`,
`layers.{i}.self_attn`, `layers.{i}.mlp`, `layers.{i}.input_layernorm`, ..., `final_norm`,
`logits`)."""

from __future__ import annotations

from torch import nn
from torch.profiler import record_function

from vllm_piep.spans.records import module_range_name


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
