"""FLOPs, memory bytes and interconnect bytes of each model component for one engine step,
per request, from the model's shape and the step's token counts. No vLLM imports.

Conventions: a multiply-add is 2 FLOPs; totals are over the whole model (all TP ranks and PP
stages together, since parallelism splits the work but does not change its sum; replicated work
is counted once). Weight reads happen once per step and are shared by the step's requests in
proportion to their tokens (logits weights: in proportion to their sampled rows). Attention over
the context counts the causal (query, key) pairs: a chunk of q new tokens after c cached ones
attends to q*c + q*(q+1)/2 pairs.

Memory bytes are each kernel's reads of its inputs and writes of its outputs as vLLM runs them
(one GEMM per merged projection, separate activation, KV-cache-write and attention kernels, the
residual add fused into the RMSNorm), counted once (no re-reads by tiling). `module_work` gives
the same numbers per module; `step_work` and `module_work` agree to rounding (tested).

Not counted: rotary embedding, softmax, the MLP activation's and bias adds' FLOPs (a few per
element, against 2*hidden per element for the GEMMs); Qwen3-style per-head q/k RMSNorms
(about 4*(q_dim + kv_dim) FLOPs per token against 2*hidden*(q_dim + 2*kv_dim) for the QKV
projection, so less than 2/hidden of it: 0.4 % at hidden 512); LayerNorm biases and, for
models that do not fuse the residual add into the norm (OPT), that add's extra write of the
hidden state; vocabulary padding; sampling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_piep.model.components import INDEX, N_COMPONENTS

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
    ) -> ModelShape:
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
    def from_rows(cls, rows: list[tuple[int, int, int, int]]) -> StepBatch:
        """From one (prefill, decode, context, sampled) tuple per request."""
        return cls(np.array(rows, dtype=np.float64).reshape(len(rows), 4))

    @classmethod
    def from_lists(
        cls, prefill: list[int], decode: list[int], context: list[int], sampled: list[int]
    ) -> StepBatch:
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


def _attention_activation_elems(h: float, q_dim: float, kv_dim: float) -> float:
    """Activation elements one token moves through attention, KV cache aside: the QKV GEMM
    reads x and writes q, k, v; the cache-write kernel reads k, v; the attention kernel reads
    q and writes its output; the O GEMM reads that and writes h."""
    return h + (q_dim + 2 * kv_dim) + 2 * kv_dim + q_dim + q_dim + q_dim + h


def _mlp_activation_elems(h: float, inter: float, gated: bool) -> float:
    """Activation elements one token moves through the MLP: read x, write the up projection(s),
    the activation kernel reads them and writes `inter`, the down projection reads that and
    writes h (SwiGLU: 2*h + 6*inter; ungated: 2*h + 4*inter)."""
    up = 2 * inter if gated else inter
    return 2 * h + 2 * up + 2 * inter


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
    # Per token: activations, plus the new K/V written to the cache and read back by attention.
    mem[_Q, att] = L * (_attention_activation_elems(h, q_dim, kv_dim) + 2 * 2 * kv_dim) * b

    mlp = INDEX["mlp"]
    n_mats = 3 if shape.gated_mlp else 2
    flops[_Q, mlp] = L * 2 * h * inter * n_mats
    mem[_TSHARE, mlp] = L * n_mats * h * inter * b
    mem[_Q, mlp] = L * _mlp_activation_elems(h, inter, shape.gated_mlp) * b

    norm = INDEX["norm"]
    n_norms = 2 * L + 1
    flops[_Q, norm] = n_norms * 4 * h
    # The first norm reads and writes the hidden state; the others also add the residual.
    mem[_Q, norm] = (2 * h + (n_norms - 1) * 4 * h) * b
    mem[_TSHARE, norm] = n_norms * h * b

    logits = INDEX["logits"]
    flops[_ROWS, logits] = 2 * h * shape.vocab
    mem[_RSHARE, logits] = shape.vocab * h * b
    mem[_ROWS, logits] = (h + shape.vocab) * b  # read the hidden row, write its logits

    if shape.tp > 1:
        # Ring all-reduce after the embedding and after every attention and MLP: each of tp
        # ranks sends 2*(tp-1)/tp of the tensor, so 2*(tp-1) tensors cross links in all.
        link[_Q, INDEX["allreduce"]] = (2 * L + 1) * 2 * (shape.tp - 1) * h * b
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


# ---- Per module ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ModuleWork:
    """One module's work in one step.

    `bytes` is all its memory traffic; `weight_bytes` and `kv_bytes` are the parts of it that
    are parameters read and KV cache read or written (the rest is activations). `collective`
    names the tensor-parallel collective that completes the module's output ("all_reduce",
    "gather" or "" when there is none, e.g. at tp == 1) and `collective_bytes` its payload per
    call: the whole tensor (tokens x hidden x dtype bytes for an all-reduce), not link traffic.
    """

    flops: float
    bytes: float
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    collective: str = ""
    collective_bytes: float = 0.0

    @property
    def activation_bytes(self) -> float:
        return self.bytes - self.weight_bytes - self.kv_bytes


# The kind of each module (the last part of its name) and the component its work belongs to.
MODULE_COMPONENT: dict[str, str] = {
    "embedding": "embedding",
    "attention_norm": "norm",  # before attention (HF/vLLM Llama: input_layernorm)
    "attention": "attention",
    "mlp_norm": "norm",        # before the MLP (Llama: post_attention_layernorm)
    "mlp": "mlp",
    "final_norm": "norm",
    "logits": "logits",
}


def module_kind(name: str) -> str:
    """'layers.3.mlp' -> 'mlp'; 'logits' -> 'logits'."""
    return name.rsplit(".", 1)[-1]


def _mw(flops: float, weight: float, act: float, kv: float = 0.0,
        collective: str = "", payload: float = 0.0) -> ModuleWork:
    return ModuleWork(flops=float(flops), bytes=float(weight + act + kv),
                      weight_bytes=float(weight), kv_bytes=float(kv),
                      collective=collective if payload else "", collective_bytes=float(payload))


def module_work(shape: ModelShape, batch: StepBatch, per_rank: bool = False
                ) -> dict[str, ModuleWork]:
    """FLOPs and memory bytes of every module for one step, in forward order.

    Names: "embedding", then per layer i "layers.{i}.attention_norm", "layers.{i}.attention"
    (QKV projection, attention over the causal context, O projection), "layers.{i}.mlp_norm",
    "layers.{i}.mlp" (gated SwiGLU or plain fc1/fc2 per `shape.gated_mlp`), then "final_norm"
    and "logits" (the LM head over the sampled rows only). `MODULE_COMPONENT[module_kind(n)]`
    maps a name to its component; summed that way, the modules give `step_work`'s totals.

    per_rank=False: the whole model, the convention of `step_work` (each piece of work counted
    once, whatever the parallel layout).

    per_rank=True: what one tensor-parallel rank does (vLLM's sharding). Sharded across the tp
    ranks: the QKV/O projections and attention by heads (KV heads replicated when there are
    fewer than tp, so each rank then holds one), the MLP by `intermediate`, the LM head and
    the embedding table by vocabulary. Replicated on every rank: the norms, the hidden-sized
    activations (each projection's input, each row-parallel output of partial sums, the
    embedding's output), the LM head's input rows. The embedding reads on average 1/tp of the
    looked-up rows per rank (each rank owns 1/tp of the vocabulary, writes zeros for the rest)
    before the all-reduce. Pipeline parallelism does not change a module's work, it decides
    which stage runs it; numbers are per step, not divided by pp.

    Collective payloads (tp > 1 only, per call): an all-reduce of tokens x hidden after the
    embedding and after each attention and MLP, a gather of sampled rows x vocab after the LM
    head. `step_work` counts 2*(tp-1) payloads of link traffic per all-reduce (ring) and
    (tp-1) per gather.
    """
    return module_work_of_totals(shape, StepTotals.of(batch), per_rank)


@dataclass(frozen=True)
class StepTotals:
    """The sums over a step's requests that module work depends on (what a step span carries):
    tokens computed, causal (query, key) pairs attended, cached context tokens read, and rows
    sent to the LM head."""

    tokens: float
    attended_pairs: float
    context_tokens: float
    sampled_rows: float

    @classmethod
    def of(cls, batch: StepBatch) -> StepTotals:
        a = batch.array
        q = a[:, 0] + a[:, 1]
        return cls(tokens=float(q.sum()),
                   attended_pairs=float((q * (a[:, 2] + (q + 1.0) * 0.5)).sum()),
                   context_tokens=float(a[:, 2].sum()), sampled_rows=float(a[:, 3].sum()))


def module_work_of_totals(shape: ModelShape, totals: StepTotals, per_rank: bool = False
                          ) -> dict[str, ModuleWork]:
    """`module_work` from a step's totals alone (e.g. a step span's), same names and numbers."""
    tokens, pairs = totals.tokens, totals.attended_pairs
    context, rows = totals.context_tokens, totals.sampled_rows

    h, b, L = float(shape.hidden), float(shape.dtype_bytes), shape.layers
    tp = float(shape.tp) if per_rank else 1.0
    q_dim = shape.heads * shape.head_dim / tp
    kv_heads = shape.kv_heads / tp if shape.kv_heads >= tp else 1.0
    kv_dim = kv_heads * shape.head_dim
    inter = shape.intermediate / tp
    vocab = shape.vocab / tp
    runs = 1.0 if tokens > 0 else 0.0  # weights are read only if the layer runs
    reduce_payload = tokens * h * b if shape.tp > 1 else 0.0

    embedding = _mw(0.0, tokens * h * b / tp, tokens * h * b,
                    collective="all_reduce", payload=reduce_payload)
    attention = _mw(
        flops=tokens * (2 * h * (q_dim + 2 * kv_dim) + 2 * q_dim * h) + 4 * q_dim * pairs,
        weight=runs * (h * (q_dim + 2 * kv_dim) + q_dim * h) * b,
        act=tokens * _attention_activation_elems(h, q_dim, kv_dim) * b,
        # Written: the new tokens' K and V. Read by attention: K and V of every attended
        # position, cached or new.
        kv=(2 * kv_dim * tokens + 2 * kv_dim * (context + tokens)) * b,
        collective="all_reduce", payload=reduce_payload)
    n_mats = 3 if shape.gated_mlp else 2
    mlp = _mw(tokens * 2 * h * inter * n_mats, runs * n_mats * h * inter * b,
              tokens * _mlp_activation_elems(h, inter, shape.gated_mlp) * b,
              collective="all_reduce", payload=reduce_payload)
    norm_flops, norm_weight = tokens * 4 * h, runs * h * b
    first_norm = _mw(norm_flops, norm_weight, tokens * 2 * h * b)  # no residual yet
    norm = _mw(norm_flops, norm_weight, tokens * 4 * h * b)  # fused residual add + norm
    logits = _mw(rows * 2 * h * vocab, (1.0 if rows > 0 else 0.0) * vocab * h * b,
                 rows * (h + vocab) * b,
                 collective="gather", payload=rows * shape.vocab * b if shape.tp > 1 else 0.0)

    out = {"embedding": embedding}
    for i in range(L):
        out[f"layers.{i}.attention_norm"] = first_norm if i == 0 else norm
        out[f"layers.{i}.attention"] = attention
        out[f"layers.{i}.mlp_norm"] = norm
        out[f"layers.{i}.mlp"] = mlp
    out["final_norm"] = norm
    out["logits"] = logits
    return out
