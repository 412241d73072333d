"""FLOPs, memory bytes and interconnect bytes of each model component for one engine step,
per request, from the model's shape and the step's token counts. No vLLM imports.

Conventions: a multiply-add is 2 FLOPs; totals are over the whole model (all TP ranks and PP
stages together, since parallelism splits the work but does not change its sum). Weight reads
happen once per step and are shared by the step's requests in proportion to their tokens
(logits weights: in proportion to their sampled rows). Attention over the context counts the
causal (query, key) pairs: a chunk of q new tokens after c cached ones attends to
q*c + q*(q+1)/2 pairs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_piep.components import INDEX, N_COMPONENTS

# Model types whose MLP is a plain two-matrix FFN; the rest we support use a gated (SwiGLU) MLP.
_UNGATED_MODEL_TYPES = frozenset({"opt", "gpt2", "gpt_neox", "gptj", "bloom", "falcon", "phi"})


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers that the work formulas need, plus the parallel layout."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int
    gated_mlp: bool = True
    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim",
                     "vocab", "dtype_bytes", "tp", "pp", "dp"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_hf_config(
        cls, cfg: Mapping[str, Any], dtype_bytes: int, tp: int = 1, pp: int = 1, dp: int = 1
    ) -> "ModelShape":
        """From a Hugging Face config dict (Llama, Qwen2/3, Mistral and OPT naming)."""
        model_type = str(cfg.get("model_type", ""))
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        intermediate = cfg.get("intermediate_size") or cfg.get("ffn_dim") or 4 * hidden
        head_dim = cfg.get("head_dim") or hidden // heads
        return cls(
            hidden=hidden,
            intermediate=int(intermediate),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab=int(cfg["vocab_size"]),
            dtype_bytes=dtype_bytes,
            gated_mlp=model_type not in _UNGATED_MODEL_TYPES,
            tp=tp,
            pp=pp,
            dp=dp,
        )


@dataclass(frozen=True)
class StepBatch:
    """What each request of one engine step computes (arrays of equal length, one per request).

    prefill_tokens: prompt tokens computed in this step (cached prefix tokens excluded)
    decode_tokens: generated tokens computed in this step (incl. recomputed after preemption)
    context_start: tokens already in the KV cache before this step
    sampled_rows: rows of logits computed for the request (0 during a partial prefill chunk)
    """

    prefill_tokens: np.ndarray
    decode_tokens: np.ndarray
    context_start: np.ndarray
    sampled_rows: np.ndarray

    @property
    def tokens(self) -> np.ndarray:
        return self.prefill_tokens + self.decode_tokens

    def __len__(self) -> int:
        return len(self.prefill_tokens)

    @classmethod
    def from_lists(
        cls, prefill: list[int], decode: list[int], context: list[int], sampled: list[int]
    ) -> "StepBatch":
        return cls(
            np.asarray(prefill, dtype=np.float64),
            np.asarray(decode, dtype=np.float64),
            np.asarray(context, dtype=np.float64),
            np.asarray(sampled, dtype=np.float64),
        )


@dataclass(frozen=True)
class StepWork:
    """Per request (rows) and component (columns, `COMPONENTS` order) work of one step."""

    flops: np.ndarray
    mem_bytes: np.ndarray
    link_bytes: np.ndarray


def _share(weights: np.ndarray) -> np.ndarray:
    total = weights.sum()
    return weights / total if total > 0 else np.zeros_like(weights)


def step_work(shape: ModelShape, batch: StepBatch) -> StepWork:
    """FLOPs, memory bytes and interconnect bytes per request and component for one step."""
    n = len(batch)
    flops = np.zeros((n, N_COMPONENTS))
    mem = np.zeros((n, N_COMPONENTS))
    link = np.zeros((n, N_COMPONENTS))
    q = batch.tokens
    c = batch.context_start
    s = batch.sampled_rows
    h, inter, L, b = shape.hidden, shape.intermediate, shape.layers, shape.dtype_bytes
    q_dim = shape.heads * shape.head_dim
    kv_dim = shape.kv_heads * shape.head_dim
    token_share = _share(q)
    row_share = _share(s)

    emb = INDEX["embedding"]
    mem[:, emb] = 2 * q * h * b  # gather the rows, write the activations

    att = INDEX["attention"]
    pairs = q * c + q * (q + 1) / 2
    proj_flops = 2 * q * h * (q_dim + 2 * kv_dim) + 2 * q * q_dim * h
    core_flops = 4 * q_dim * pairs  # QK^T and PV
    flops[:, att] = L * (proj_flops + core_flops)
    attn_weights = (h * (q_dim + 2 * kv_dim) + q_dim * h) * b
    kv_bytes = (c + 2 * q) * 2 * kv_dim * b  # read the cached context, write the new K/V
    act_bytes = q * (2 * h + q_dim + 2 * kv_dim + q_dim) * b
    mem[:, att] = L * (attn_weights * token_share + kv_bytes + act_bytes)

    mlp = INDEX["mlp"]
    n_mats = 3 if shape.gated_mlp else 2
    flops[:, mlp] = L * 2 * q * h * inter * n_mats
    mem[:, mlp] = L * (n_mats * h * inter * b * token_share + q * (2 * h + n_mats * inter) * b)

    norm = INDEX["norm"]
    n_norms = 2 * L + 1
    flops[:, norm] = n_norms * 4 * q * h
    mem[:, norm] = n_norms * (2 * q * h * b + h * b * token_share)

    logits = INDEX["logits"]
    flops[:, logits] = 2 * s * h * shape.vocab
    mem[:, logits] = shape.vocab * h * b * row_share + s * shape.vocab * 4  # fp32 logits

    if shape.tp > 1:
        # Ring all-reduce after attention and after the MLP: each of tp ranks sends
        # 2*(tp-1)/tp of the tensor, so 2*(tp-1) tensors cross links in all.
        link[:, INDEX["allreduce"]] = L * 2 * 2 * (shape.tp - 1) * q * h * b
        # Vocab-parallel LM head: every rank's shard of the sampled rows goes to the others.
        link[:, INDEX["allgather"]] = (shape.tp - 1) * s * shape.vocab * b
    if shape.pp > 1:
        # Hidden states and residual cross each stage boundary.
        link[:, INDEX["p2p"]] = (shape.pp - 1) * 2 * q * h * b
    return StepWork(flops=flops, mem_bytes=mem, link_bytes=link)
