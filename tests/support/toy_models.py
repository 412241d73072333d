"""A toy decoder shaped as vLLM's models look to the tree builder (module names, an attention
kernel with `impl` and `head_size`, `reduce_results` under tensor parallelism, missing layers
of other pipeline stages), small enough to run on the CPU in a test."""

from __future__ import annotations

import torch
from torch import nn

HIDDEN = 8


class Kernel(nn.Module):  # what vLLM's Attention layer looks like to the tree builder
    def __init__(self) -> None:
        super().__init__()
        self.impl = object()
        self.head_size = 4


class Linear(nn.Module):
    def __init__(self, reduce: bool, tp: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(0))  # vLLM CPU: packed away, left empty
        self.reduce_results, self.tp_size = reduce, tp


class Attention(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = Linear(False, tp), Linear(True, tp)
        self.attn = Kernel()


class Mlp(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = Linear(False, tp), Linear(True, tp)


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))


EXPERTS = 4


class Router(nn.Module):  # vLLM's GateLinear / ReplicatedLinear: one weight row per expert
    def __init__(self, rows: int = EXPERTS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, HIDDEN))


class FusedExperts(nn.Module):  # what vLLM's FusedMoE looks like to the tree builder
    def __init__(self, tp: int, ep: bool, holds: list[nn.Module]) -> None:
        super().__init__()
        self.top_k, self.global_num_experts = 2, EXPERTS
        self.w13_weight = nn.Parameter(torch.zeros(EXPERTS, 2, HIDDEN))
        self.use_ep, self.reduce_results, self.tp_size = ep, True, tp
        # vLLM keeps the router and shared expert it calls in a runner, unregistered.
        self.__dict__["runner"] = type("Runner", (), {})()
        for i, module in enumerate(holds):
            setattr(self.__dict__["runner"], f"held{i}", module)


class MoeBlock(nn.Module):
    """Qwen2/3-MoE in vLLM: gate, experts, shared expert and its gate; the fused experts call
    the router and shared expert themselves when `inside`."""

    def __init__(self, tp: int, inside: bool, ep: bool, shared: bool) -> None:
        super().__init__()
        self.gate = Router()
        if shared:
            self.shared_expert = Mlp(tp)
            self.shared_expert_gate = Router(rows=1)
        holds = [self.gate, *([self.shared_expert] if shared else [])] if inside else []
        self.experts = FusedExperts(tp, ep, holds)


class Layer(nn.Module):
    def __init__(self, tp: int, opt_style: bool = False, moe: dict | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(tp)
        if moe is not None:
            self.mlp = MoeBlock(tp, **moe)
            self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()
        elif opt_style:  # OPT: the MLP is two linears and an activation directly in the layer
            self.self_attn_layer_norm = Norm()
            self.fc1, self.act = Linear(False, tp), nn.ReLU()
            self.fc2 = Linear(True, tp)
            self.final_layer_norm = Norm()
        else:
            self.mlp = Mlp(tp)
            self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()


class Missing(nn.Identity):  # vLLM's PPMissingLayer
    pass


class Embedding(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.num_embeddings = 32
        self.weight = nn.Parameter(torch.zeros(32 // tp, HIDDEN))
        self.reduce_results, self.tp_size = True, tp


class Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vocab_size = self.org_vocab_size = 32
        self.use_all_gather = True


class Base(nn.Module):
    def __init__(self, tp: int, layers: int, held: range, first: bool, last: bool,
                 opt_style: bool, moe: dict | None = None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(tp) if first else Missing()
        self.layers = nn.ModuleList(Layer(tp, opt_style, moe) if i in held else Missing()
                                    for i in range(layers))
        self.norm = Norm() if last else Missing()


class CausalLM(nn.Module):
    def __init__(self, tp: int = 1, layers: int = 2, held: range | None = None,
                 first: bool = True, last: bool = True, opt_style: bool = False,
                 moe: dict | None = None) -> None:
        """`moe`: MoeBlock's arguments (inside, ep, shared) for an MoE model."""
        super().__init__()
        self.model = Base(tp, layers, held if held is not None else range(layers), first, last,
                          opt_style, moe)
        self.lm_head = Embedding(tp)  # never called: the logits processor uses its weight
        self.logits_processor = Logits()
