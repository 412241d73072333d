"""The plugin's model-tree nodes, and detail mode's profiler ranges, on a Hugging Face
transformers decoder (Llama, Qwen2/3, Qwen3-MoE, Mistral: `model.model.layers`, `lm_head`).

Node ids and types are `model/tree.py`'s (`embedding`, `layers.{i}` and its
`layers.{i}.{attribute}` children, `layers.{i}.mlp.gate` and `.experts` in an MoE block,
`final_norm`, `logits`); the ranges are `record_function`s named as detail mode names them
(`piep.module/TYPE/NODE`, `piep.step/N`), opened in forward pre-hooks and closed in forward
hooks, so that `kernels_trace` cuts a torch.profiler trace of the model into the same spans.
The tree itself is built from vLLM's modules (`ModelTree.from_module`); this names the same
nodes where vLLM is not there: the GPU check and the tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_piep.spans.records import module_range_name, step_range_name


def tree_modules(model: Any) -> list[tuple[str, str, Any]]:
    """(node id, node type, module) of every node, in execution order within each parent."""
    base = model.model
    nodes: list[tuple[str, str, Any]] = [("embedding", "embedding", base.embed_tokens)]
    for i, layer in enumerate(base.layers):
        nodes += [(f"layers.{i}", "layer", layer),
                  (f"layers.{i}.input_layernorm", "norm", layer.input_layernorm),
                  (f"layers.{i}.self_attn", "attention", layer.self_attn),
                  (f"layers.{i}.post_attention_layernorm", "norm",
                   layer.post_attention_layernorm),
                  (f"layers.{i}.mlp", "mlp", layer.mlp)]
        if hasattr(layer.mlp, "experts"):
            nodes += [(f"layers.{i}.mlp.gate", "router", layer.mlp.gate),
                      (f"layers.{i}.mlp.experts", "experts", layer.mlp.experts)]
    nodes += [("final_norm", "final_norm", base.norm), ("logits", "logits", model.lm_head)]
    return nodes


def annotate(nodes: list[tuple[str, str, Any]]) -> list[Any]:
    """Hooks that open and close each node's range; returns their handles (`.remove()`)."""
    from torch.autograd.profiler import record_function

    handles = []
    for node, kind, module in nodes:
        name = module_range_name(kind, node)
        open_ranges: list[Any] = []

        def enter(_m: Any, _a: Any, name: str = name, stack: list[Any] = open_ranges) -> None:
            rf = record_function(name)
            rf.__enter__()
            stack.append(rf)

        def leave(_m: Any, _a: Any, _o: Any, stack: list[Any] = open_ranges) -> None:
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


@contextmanager
def module_ranges(model: Any) -> Iterator[list[tuple[str, str, Any]]]:
    """Every node's range around its module's forward while the context is open; yields the
    nodes."""
    nodes = tree_modules(model)
    handles = annotate(nodes)
    try:
        yield nodes
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def step_range(index: int) -> Iterator[None]:
    from torch.autograd.profiler import record_function

    with record_function(step_range_name(index)):
        yield
