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

from dataclasses import dataclass

import numpy as np

from vllm_piep.model.components import INDEX, N_COMPONENTS
from vllm_piep.model.shape import ModelShape, ShapeError

__all__ = ["ModelShape", "ShapeError", "StepBatch", "StepWork", "step_work", "module_work"]

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
# product: features (requests x 7) @ coefficients (7 x components). The one term that is not,
# the routed experts' weight reads of an MoE model, is a function of the step's token count
# (`expert_read_fraction`) shared by token share.
FEATURES: tuple[str, ...] = (
    "tokens",          # q: tokens computed for the request in this step
    "attended_pairs",  # causal (query, key) pairs: q*c + q*(q+1)/2
    "context",         # c: tokens already in the KV cache
    "sampled_rows",    # s: rows of logits
    "token_share",     # q / sum(q): share of the weight reads of the layers
    "row_share",       # s / sum(s): share of the LM-head weight read
    "requests",        # 1: per-request state (a Mamba layer's recurrent state)
)
_Q, _PAIRS, _CTX, _ROWS, _TSHARE, _RSHARE, _REQ = range(len(FEATURES))


@dataclass(frozen=True)
class WorkCoefficients:
    """FLOPs, memory bytes and link bytes per unit of each feature (len(FEATURES) x components),
    and the routed experts' weight bytes when every expert is read (`expert_bytes_full`; the
    step reads `expert_read_fraction` of them)."""

    flops: np.ndarray
    mem_bytes: np.ndarray
    link_bytes: np.ndarray
    expert_bytes_full: float = 0.0
    expert_miss: float = 1.0  # probability that one token's routing leaves a given expert out


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


@dataclass(frozen=True)
class LayerTerms:
    """One layer kind's work per unit, in elements (times bytes where they are bytes):
    FLOPs per token and per attended pair, weights read once per step, activations per token,
    KV cache per new token (written, then read by attention) and per cached token read, and
    recurrent state read and written per request."""

    flops_token: float = 0.0
    flops_pair: float = 0.0
    weights: float = 0.0
    act_token: float = 0.0
    kv_token: float = 0.0
    kv_context: float = 0.0
    state_request: float = 0.0


def _tp_split(shape: ModelShape, tp: float) -> tuple[float, float]:
    """(q_dim, kv_dim) on one rank: heads sharded, KV heads replicated below tp."""
    kv_heads = shape.kv_heads / tp if shape.kv_heads >= tp else 1.0
    return shape.heads * shape.head_dim / tp, kv_heads * shape.head_dim


def attention_terms(shape: ModelShape, tp: float = 1.0) -> LayerTerms:
    """Multi-head / grouped-query attention, or DeepSeek's MLA as vLLM runs it (queries
    absorbed into the compressed latent: the cache holds kv_lora_rank + rope values per token,
    attention reads them for scores and values; one formula for prefill and decode)."""
    h = float(shape.hidden)
    if not shape.is_mla:
        q, kv = _tp_split(shape, tp)
        return LayerTerms(flops_token=2 * h * (q + 2 * kv) + 2 * q * h, flops_pair=4 * q,
                          weights=h * (q + 2 * kv) + q * h,
                          act_token=_attention_activation_elems(h, q, kv),
                          kv_token=4 * kv, kv_context=2 * kv)
    nq = shape.heads / tp
    qk = shape.qk_nope_dim + shape.qk_rope_dim
    kvl, v = float(shape.kv_lora_rank), float(shape.v_head_dim)
    latent = kvl + shape.qk_rope_dim
    ql = float(shape.q_lora_rank)
    q_weights = h * ql + ql * nq * qk if ql else h * nq * qk
    weights = q_weights + h * latent + nq * kvl * (shape.qk_nope_dim + v) + nq * v * h
    return LayerTerms(
        flops_token=2 * weights, flops_pair=2 * nq * (latent + kvl), weights=weights,
        act_token=2 * h + nq * qk + latent + 2 * nq * latent + 2 * nq * kvl + 2 * nq * v,
        kv_token=2 * latent, kv_context=latent)


def mamba_terms(shape: ModelShape, tp: float = 1.0) -> LayerTerms:
    """A Mamba-2 mixer block: in-projection to x, z, B, C and dt, the causal convolution, the
    state-space scan (state update and readout: 6 FLOPs per channel and state element), the
    out-projection; its recurrent and convolution states read and written once per request and
    step. No KV cache."""
    h = float(shape.hidden)
    d = shape.mamba_heads * shape.mamba_head_dim / tp
    gn = shape.mamba_groups * shape.mamba_state / (tp if shape.mamba_groups >= tp else 1.0)
    nh = shape.mamba_heads / tp
    conv_ch = d + 2 * gn
    proj = h * (2 * d + 2 * gn + nh) + d * h
    weights = proj + shape.mamba_conv * conv_ch
    return LayerTerms(
        flops_token=2 * proj + 2 * shape.mamba_conv * conv_ch + 6 * d * shape.mamba_state,
        weights=weights, act_token=2 * h + 2 * d + 2 * gn + nh + 2 * conv_ch + 5 * d,
        state_request=2 * (d * shape.mamba_state + (shape.mamba_conv - 1) * conv_ch))


def mlp_terms(shape: ModelShape, width: float) -> LayerTerms:
    h = float(shape.hidden)
    n_mats = 3 if shape.gated_mlp else 2
    return LayerTerms(flops_token=2 * h * width * n_mats, weights=n_mats * h * width,
                      act_token=_mlp_activation_elems(h, width, shape.gated_mlp))


def moe_terms(shape: ModelShape, tp: float = 1.0) -> tuple[LayerTerms, float]:
    """An MoE layer's router, top-k routed experts and shared expert per token, and (apart)
    the routed experts' weights when all are read (sharded by expert parallelism, else by
    width across the tensor-parallel ranks)."""
    h = float(shape.hidden)
    split = float(shape.ep) if shape.ep > 1 else tp
    routed = mlp_terms(shape, shape.expert_intermediate)
    shared = (mlp_terms(shape, shape.shared_intermediate / tp) if shape.shared_intermediate
              else LayerTerms())
    k, e = float(shape.top_k), float(shape.experts)
    terms = LayerTerms(
        flops_token=2 * h * e + k * routed.flops_token / split + shared.flops_token,
        weights=h * e + shared.weights,
        act_token=h + e + k * routed.act_token / split + shared.act_token)
    return terms, e * routed.weights / split


def expert_read_fraction(shape: ModelShape, tokens: float | np.ndarray) -> float | np.ndarray:
    """Expected share of a layer's routed experts that `tokens` tokens read, with routing
    uniform and independent across tokens: 1 - (1 - k/E)^tokens. Decode at small batch reads
    k of E experts' weights; a long prefill reads them all."""
    if not shape.is_moe:
        return 0.0
    return 1.0 - np.power(1.0 - shape.top_k / shape.experts, tokens)


def _dense_mlp_layers(shape: ModelShape) -> int:
    return shape.n_mlp - shape.moe_layers


def work_coefficients(shape: ModelShape) -> WorkCoefficients:
    flops = np.zeros((len(FEATURES), N_COMPONENTS))
    mem = np.zeros_like(flops)
    link = np.zeros_like(flops)
    h, b, wb = shape.hidden, shape.dtype_bytes, shape.wbytes

    def add(component: str, count: int, t: LayerTerms) -> None:
        c = INDEX[component]
        flops[_Q, c] += count * t.flops_token
        flops[_PAIRS, c] += count * t.flops_pair
        mem[_TSHARE, c] += count * t.weights * wb
        mem[_Q, c] += count * (t.act_token + t.kv_token) * b
        mem[_CTX, c] += count * t.kv_context * b
        mem[_REQ, c] += count * t.state_request * b

    mem[_Q, INDEX["embedding"]] = 2 * h * b  # gather the rows, write the activations
    add("attention", shape.n_attention, attention_terms(shape))
    add("attention", shape.mamba_layers, mamba_terms(shape))  # the token mixer of its block
    add("mlp", _dense_mlp_layers(shape), mlp_terms(shape, shape.intermediate))
    full = 0.0
    if shape.is_moe:
        terms, routed_weights = moe_terms(shape)
        add("mlp", shape.moe_layers, terms)
        full = shape.moe_layers * routed_weights * wb

    norm = INDEX["norm"]
    n_norms = shape.n_norms
    flops[_Q, norm] = n_norms * 4 * h
    # The first norm reads and writes the hidden state; the others also add the residual.
    mem[_Q, norm] = (2 * h + (n_norms - 1) * 4 * h) * b
    mem[_TSHARE, norm] = n_norms * h * b

    logits = INDEX["logits"]
    flops[_ROWS, logits] = 2 * h * shape.vocab
    mem[_RSHARE, logits] = shape.vocab * h * b
    mem[_ROWS, logits] = (h + shape.vocab) * b  # read the hidden row, write its logits

    if shape.tp > 1:
        # Ring all-reduce after the embedding and after every mixer and MLP: each of tp ranks
        # sends 2*(tp-1)/tp of the tensor, so 2*(tp-1) tensors cross links in all.
        reduces = shape.n_attention + shape.mamba_layers + shape.n_mlp + 1
        link[_Q, INDEX["allreduce"]] = reduces * 2 * (shape.tp - 1) * h * b
        # Vocab-parallel LM head: every rank's shard of the sampled rows goes to the others.
        link[_ROWS, INDEX["allgather"]] = (shape.tp - 1) * shape.vocab * b
    if shape.pp > 1:
        # Hidden states and residual cross each stage boundary.
        link[_Q, INDEX["p2p"]] = (shape.pp - 1) * 2 * h * b
    if shape.is_moe and shape.ep > 1:
        # Expert parallel: each token's k expert inputs go out (dispatch) and their outputs
        # come back (combine); (ep-1)/ep of them live on another rank.
        link[_Q, INDEX["alltoall"]] = (shape.moe_layers * 2 * shape.top_k * h * b
                                       * (shape.ep - 1) / shape.ep)
    return WorkCoefficients(flops=flops, mem_bytes=mem, link_bytes=link,
                            expert_bytes_full=full,
                            expert_miss=1.0 - shape.top_k / shape.experts if shape.is_moe
                            else 1.0)


def step_features(batch: StepBatch) -> np.ndarray:
    """The (requests x FEATURES) matrix of one step, in a dozen whole-array operations."""
    a = batch.array
    f = np.empty((a.shape[0], len(FEATURES)))
    q = np.add(a[:, 0], a[:, 1], out=f[:, _Q])
    f[:, _CTX:_ROWS + 1] = a[:, 2:4]
    np.multiply(q, a[:, 2] + (q + 1.0) * 0.5, out=f[:, _PAIRS])
    f[:, _REQ] = 1.0
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
    mem = f @ co.mem_bytes
    if co.expert_bytes_full:
        read = co.expert_bytes_full * expert_read_fraction(shape, f[:, _Q].sum())
        mem[:, INDEX["mlp"]] += f[:, _TSHARE] * read
    return StepWork(flops=f @ co.flops, mem_bytes=mem, link_bytes=f @ co.link_bytes)


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
    "mamba_norm": "norm",      # before a Mamba-2 block (hybrids)
    "mamba": "attention",      # a hybrid's token mixer is counted with attention
    "experts": "mlp",          # an MoE block's parts (model tree nodes; `moe_part_work`)
    "router": "mlp",
    "shared_expert": "mlp",
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
    requests: float = 0.0  # 0 where unknown (a span): a Mamba block's state then goes uncounted

    @classmethod
    def of(cls, batch: StepBatch) -> StepTotals:
        a = batch.array
        q = a[:, 0] + a[:, 1]
        return cls(tokens=float(q.sum()),
                   attended_pairs=float((q * (a[:, 2] + (q + 1.0) * 0.5)).sum()),
                   context_tokens=float(a[:, 2].sum()), sampled_rows=float(a[:, 3].sum()),
                   requests=float(len(a)))


def _module_of(t: LayerTerms, tokens: float, pairs: float, context: float, requests: float,
               b: float, wb: float, runs: float, collective: str, payload: float
               ) -> ModuleWork:
    return _mw(tokens * t.flops_token + pairs * t.flops_pair, runs * t.weights * wb,
               tokens * t.act_token * b + requests * t.state_request * b,
               kv=(t.kv_token * tokens + t.kv_context * context) * b,
               collective=collective, payload=payload)


def module_work_of_totals(shape: ModelShape, totals: StepTotals, per_rank: bool = False
                          ) -> dict[str, ModuleWork]:
    """`module_work` from a step's totals alone (e.g. a step span's), same names and numbers."""
    tokens, pairs = totals.tokens, totals.attended_pairs
    context, rows, requests = totals.context_tokens, totals.sampled_rows, totals.requests

    h, b, wb = float(shape.hidden), float(shape.dtype_bytes), shape.wbytes
    tp = float(shape.tp) if per_rank else 1.0
    vocab = shape.vocab / tp
    runs = 1.0 if tokens > 0 else 0.0  # weights are read only if the layer runs
    reduce_payload = tokens * h * b if shape.tp > 1 else 0.0

    def of(t: LayerTerms, collective: str = "all_reduce", payload: float = reduce_payload
           ) -> ModuleWork:
        return _module_of(t, tokens, pairs, context, requests, b, wb, runs, collective,
                          payload)

    embedding = _mw(0.0, tokens * h * b / tp, tokens * h * b,
                    collective="all_reduce", payload=reduce_payload)
    attention = of(attention_terms(shape, tp))
    dense_mlp = of(mlp_terms(shape, shape.intermediate / tp))
    moe_mlp = dense_mlp
    if shape.is_moe:
        terms, routed = moe_terms(shape, tp)
        read = routed * float(expert_read_fraction(shape, tokens))
        terms = LayerTerms(flops_token=terms.flops_token, weights=terms.weights + read,
                           act_token=terms.act_token)
        if shape.ep > 1:  # dispatch: each token's k expert inputs (combine: as many back)
            moe_mlp = of(terms, "all_to_all", tokens * shape.top_k * h * b)
        else:
            moe_mlp = of(terms)
    norm_flops, norm_weight = tokens * 4 * h, runs * h * b
    first_norm = _mw(norm_flops, norm_weight, tokens * 2 * h * b)  # no residual yet
    norm = _mw(norm_flops, norm_weight, tokens * 4 * h * b)  # fused residual add + norm
    logits = _mw(rows * 2 * h * vocab, (1.0 if rows > 0 else 0.0) * vocab * h * b,
                 rows * (h + vocab) * b,
                 collective="gather", payload=rows * shape.vocab * b if shape.tp > 1 else 0.0)

    out = {"embedding": embedding}
    if shape.mamba_layers:
        # Hybrid blocks, one norm each, grouped by kind (the config's order is not kept).
        mamba = of(mamba_terms(shape, tp))
        blocks = ([("mamba", mamba)] * shape.mamba_layers
                  + [("attention", attention)] * shape.n_attention
                  + [("mlp", dense_mlp)] * shape.n_mlp)
        for i, (kind, work) in enumerate(blocks):
            out[f"layers.{i}.{kind}_norm"] = first_norm if i == 0 else norm
            out[f"layers.{i}.{kind}"] = work
    else:
        dense = _dense_mlp_layers(shape)  # first layers dense, as DeepSeek's (sums hold)
        for i in range(shape.layers):
            out[f"layers.{i}.attention_norm"] = first_norm if i == 0 else norm
            out[f"layers.{i}.attention"] = attention
            out[f"layers.{i}.mlp_norm"] = norm
            out[f"layers.{i}.mlp"] = dense_mlp if i < dense else moe_mlp
    out["final_norm"] = norm
    out["logits"] = logits
    return out


def moe_part_work(shape: ModelShape, totals: StepTotals, per_rank: bool = False
                  ) -> dict[str, ModuleWork]:
    """One MoE layer's `mlp` work in its parts (they sum to it): "router", "routed" (the
    top-k experts, their weights read as `expert_read_fraction` says, the all-to-all payload
    under expert parallelism) and "shared_expert"; {} for a dense model."""
    if not shape.is_moe:
        return {}
    tokens, b, wb = totals.tokens, float(shape.dtype_bytes), shape.wbytes
    h = float(shape.hidden)
    tp = float(shape.tp) if per_rank else 1.0
    runs = 1.0 if tokens > 0 else 0.0
    split = float(shape.ep) if shape.ep > 1 else tp
    e, k = float(shape.experts), float(shape.top_k)
    routed = mlp_terms(shape, shape.expert_intermediate)
    read = e * routed.weights / split * float(expert_read_fraction(shape, tokens))
    out = {
        "router": _mw(tokens * 2 * h * e, runs * h * e * wb, tokens * (h + e) * b),
        "routed": _mw(tokens * k * routed.flops_token / split, read * wb,
                      tokens * k * routed.act_token / split * b,
                      collective="all_to_all" if shape.ep > 1 else "",
                      payload=tokens * k * h * b if shape.ep > 1 else 0.0),
    }
    if shape.shared_intermediate:
        shared = mlp_terms(shape, shape.shared_intermediate / tp)
        out["shared_expert"] = _mw(tokens * shared.flops_token, runs * shared.weights * wb,
                                   tokens * shared.act_token * b)
    return out


def add_work(parts: list[ModuleWork]) -> ModuleWork:
    """Work of modules run as one (a span that holds them): sums, the first collective."""
    coll = next((w for w in parts if w.collective), None)
    return ModuleWork(flops=sum(w.flops for w in parts), bytes=sum(w.bytes for w in parts),
                      weight_bytes=sum(w.weight_bytes for w in parts),
                      kv_bytes=sum(w.kv_bytes for w in parts),
                      collective=coll.collective if coll else "",
                      collective_bytes=coll.collective_bytes if coll else 0.0)


def parameter_counts(shape: ModelShape, tied_embeddings: bool = False) -> tuple[float, float]:
    """(total, active per token) parameters the work formulas read: embedding, LM head (unless
    tied), every layer's weights, the final and per-layer norms. A check of the formulas'
    weight reads against published parameter counts."""
    h, v = float(shape.hidden), float(shape.vocab)
    layers = (shape.n_attention * attention_terms(shape).weights
              + shape.mamba_layers * mamba_terms(shape).weights
              + (shape.n_mlp - shape.moe_layers) * mlp_terms(shape, shape.intermediate).weights
              + shape.n_norms * h)
    total = active = layers + v * h * (1 if tied_embeddings else 2)
    if shape.is_moe:
        terms, routed_all = moe_terms(shape)
        total += shape.moe_layers * (terms.weights + routed_all)
        active += shape.moe_layers * (terms.weights + routed_all * shape.top_k / shape.experts)
    return total, active
