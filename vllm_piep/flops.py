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
    """What each request of one engine step computes: one row per request of `array`, columns:

    prefill_tokens: prompt tokens computed in this step (cached prefix tokens excluded)
    decode_tokens: generated tokens computed in this step (incl. recomputed after preemption)
    context_start: tokens already in the KV cache before this step
    sampled_rows: rows of logits computed for the request (0 during a partial prefill chunk)

    One 2-D array rather than four: every numpy call costs microseconds on the engine's
    critical path, so the hot path works on whole blocks.
    """

    array: np.ndarray  # (requests, 4) float64

    @property
    def prefill_tokens(self) -> np.ndarray:
        return self.array[:, 0]

    @property
    def decode_tokens(self) -> np.ndarray:
        return self.array[:, 1]

    @property
    def context_start(self) -> np.ndarray:
        return self.array[:, 2]

    @property
    def sampled_rows(self) -> np.ndarray:
        return self.array[:, 3]

    @property
    def tokens(self) -> np.ndarray:
        return self.array[:, 0] + self.array[:, 1]

    def __len__(self) -> int:
        return self.array.shape[0]

    @classmethod
    def from_rows(cls, rows: list[tuple[int, int, int, int]]) -> "StepBatch":
        """From one (prefill, decode, context, sampled) tuple per request."""
        return cls(np.array(rows, dtype=np.float64).reshape(len(rows), 4))

    @classmethod
    def from_lists(
        cls, prefill: list[int], decode: list[int], context: list[int], sampled: list[int]
    ) -> "StepBatch":
        return cls.from_rows(list(zip(prefill, decode, context, sampled, strict=True)))


@dataclass(frozen=True)
class StepWork:
    """Per request (rows) and component (columns, `COMPONENTS` order) work of one step."""

    flops: np.ndarray
    mem_bytes: np.ndarray
    link_bytes: np.ndarray


# Every work formula is linear in these per-request features, so a step's work is one matrix
# product: features (requests x 6) @ coefficients (6 x components).
FEATURES: tuple[str, ...] = (
    "tokens",          # q: tokens computed for the request in this step
    "attended_pairs",  # causal (query, key) pairs: q*c + q*(q+1)/2
    "context",         # c: tokens already in the KV cache
    "sampled_rows",    # s: rows of logits
    "token_share",     # q / sum(q): share of the weight reads of the layers
    "row_share",       # s / sum(s): share of the LM-head weight read
)
_Q, _PAIRS, _CTX, _ROWS, _TSHARE, _RSHARE = range(len(FEATURES))


@dataclass(frozen=True)
class WorkCoefficients:
    """FLOPs, memory bytes and link bytes per unit of each feature (len(FEATURES) x components)."""

    flops: np.ndarray
    mem_bytes: np.ndarray
    link_bytes: np.ndarray


def work_coefficients(shape: ModelShape) -> WorkCoefficients:
    flops = np.zeros((len(FEATURES), N_COMPONENTS))
    mem = np.zeros_like(flops)
    link = np.zeros_like(flops)
    h, inter, L, b = shape.hidden, shape.intermediate, shape.layers, shape.dtype_bytes
    q_dim = shape.heads * shape.head_dim
    kv_dim = shape.kv_heads * shape.head_dim

    mem[_Q, INDEX["embedding"]] = 2 * h * b  # gather the rows, write the activations

    att = INDEX["attention"]
    flops[_Q, att] = L * (2 * h * (q_dim + 2 * kv_dim) + 2 * q_dim * h)  # QKV and O projections
    flops[_PAIRS, att] = L * 4 * q_dim  # QK^T and PV over the attended pairs
    mem[_TSHARE, att] = L * (h * (q_dim + 2 * kv_dim) + q_dim * h) * b  # weights
    mem[_CTX, att] = L * 2 * kv_dim * b  # read the cached K/V
    # new K/V written and read back by attention (2 x 2*kv_dim per token), plus activations
    mem[_Q, att] = L * (2 * 2 * kv_dim + 2 * h + q_dim + 2 * kv_dim + q_dim) * b

    mlp = INDEX["mlp"]
    n_mats = 3 if shape.gated_mlp else 2
    flops[_Q, mlp] = L * 2 * h * inter * n_mats
    mem[_TSHARE, mlp] = L * n_mats * h * inter * b
    mem[_Q, mlp] = L * (2 * h + n_mats * inter) * b

    norm = INDEX["norm"]
    n_norms = 2 * L + 1
    flops[_Q, norm] = n_norms * 4 * h
    mem[_Q, norm] = n_norms * 2 * h * b
    mem[_TSHARE, norm] = n_norms * h * b

    logits = INDEX["logits"]
    flops[_ROWS, logits] = 2 * h * shape.vocab
    mem[_RSHARE, logits] = shape.vocab * h * b
    mem[_ROWS, logits] = shape.vocab * 4  # fp32 logits

    if shape.tp > 1:
        # Ring all-reduce after attention and after the MLP: each of tp ranks sends
        # 2*(tp-1)/tp of the tensor, so 2*(tp-1) tensors cross links in all.
        link[_Q, INDEX["allreduce"]] = L * 2 * 2 * (shape.tp - 1) * h * b
        # Vocab-parallel LM head: every rank's shard of the sampled rows goes to the others.
        link[_ROWS, INDEX["allgather"]] = (shape.tp - 1) * shape.vocab * b
    if shape.pp > 1:
        # Hidden states and residual cross each stage boundary.
        link[_Q, INDEX["p2p"]] = (shape.pp - 1) * 2 * h * b
    return WorkCoefficients(flops=flops, mem_bytes=mem, link_bytes=link)


def step_features(batch: StepBatch) -> np.ndarray:
    """The (requests x FEATURES) matrix of one step, in a dozen whole-array operations."""
    a = batch.array
    f = np.empty((a.shape[0], len(FEATURES)))
    q = np.add(a[:, 0], a[:, 1], out=f[:, _Q])
    f[:, _CTX:_ROWS + 1] = a[:, 2:4]
    np.multiply(q, a[:, 2] + (q + 1.0) * 0.5, out=f[:, _PAIRS])
    counts = f[:, _Q:_ROWS + 1:_ROWS - _Q]  # a view of the tokens and sampled-rows columns
    totals = counts.sum(axis=0)
    if totals.min() > 0:
        np.divide(counts, totals, out=f[:, _TSHARE:_RSHARE + 1])
    else:  # no rows sampled (or no tokens) in the step: that share is zero
        f[:, _TSHARE:_RSHARE + 1] = 0.0
        np.divide(counts, totals, out=f[:, _TSHARE:_RSHARE + 1], where=totals > 0)
    return f


def step_work(shape: ModelShape, batch: StepBatch) -> StepWork:
    """FLOPs, memory bytes and interconnect bytes per request and component for one step."""
    f = step_features(batch)
    co = work_coefficients(shape)
    return StepWork(flops=f @ co.flops, mem_bytes=f @ co.mem_bytes, link_bytes=f @ co.link_bytes)
