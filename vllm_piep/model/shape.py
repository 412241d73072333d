"""The architecture numbers the work formulas need (`ModelShape`), read from a Hugging Face
config: dense decoders, mixture-of-experts (Mixtral, Qwen2/3-MoE with shared experts, gpt-oss,
Llama 4 with interleaved MoE and dense layers, DeepSeek-V2/V3 with MLA attention and first dense
layers), Mamba-2 hybrids (Nemotron-H) and the checkpoint's weight precision.

What a config does not say is assumed in one stated way and recorded in `ModelShape.notes`, which
the predictor's bundle id carries, so a response says when its model was approximated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Model types whose MLP is a plain two-matrix FFN; the rest we support use a gated (SwiGLU) MLP.
_UNGATED_MODEL_TYPES = frozenset({"opt", "gpt2", "gpt_neox", "gptj", "bloom", "falcon", "phi",
                                  "starcoder2", "nemotron_h"})

# Bytes per weight by the checkpoint's quantization (`quantization_config.quant_method`, or its
# bit width). Block-scaled formats carry their scales: MXFP4 is 4 bits + one 8-bit scale per 32
# weights (OCP MX spec) = 4.25 bits; GPTQ/AWQ 4-bit with group 128 carry a 16-bit scale and a
# 4-bit zero per group = 4.16 bits.
_WEIGHT_BYTES_BY_METHOD: dict[str, float] = {
    "fp8": 1.0, "fbgemm_fp8": 1.0, "modelopt": 1.0, "ptpc_fp8": 1.0,
    "mxfp4": 4.25 / 8, "gptq": 4.16 / 8, "awq": 4.16 / 8, "awq_marlin": 4.16 / 8,
    "gptq_marlin": 4.16 / 8, "bitsandbytes": 4.16 / 8, "nvfp4": 4.5 / 8,
}
_WEIGHT_BYTES_BY_PRECISION: dict[str, float] = {
    "bfloat16": 2.0, "float16": 2.0, "fp16": 2.0, "bf16": 2.0, "float32": 4.0, "fp32": 4.0,
    "fp8": 1.0, "int8": 1.0, "mxfp4": 4.25 / 8, "nvfp4": 4.5 / 8, "int4": 4.16 / 8,
}


class ShapeError(ValueError):
    """A config the shape cannot read: the message names the field."""


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers the work formulas need, plus the parallel layout.

    Dense fields describe every layer; the rest are zero unless the model has them:
    - MoE: `experts` routed experts per MoE layer of width `expert_intermediate`, `top_k` of them
      per token, a `shared_intermediate`-wide shared expert, `moe_layers` of the `layers` (the
      others run a dense MLP of width `intermediate`), expert parallelism over `ep` ranks.
    - MLA (DeepSeek): `kv_lora_rank` > 0; queries through `q_lora_rank` (0: a full projection),
      per head `qk_nope_dim` + `qk_rope_dim` for queries and keys, `v_head_dim` for values.
    - Mamba-2 hybrids: `mamba_layers` mixer blocks (`mamba_heads` x `mamba_head_dim` channels,
      `mamba_groups` groups of state `mamba_state`, convolution `mamba_conv`);
      `attention_layers` and `mlp_layers` count the other blocks (0: every layer has both).
    """

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
    weight_bytes: float = 0.0  # per weight; 0: the activation dtype's
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    moe_layers: int = 0
    ep: int = 1
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    attention_layers: int = 0
    mlp_layers: int = 0
    mamba_layers: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    mamba_conv: int = 0
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim",
                     "vocab", "dtype_bytes", "tp", "pp", "dp", "ep"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive, got {getattr(self, name)}")
        if self.experts and not (0 < self.top_k <= self.experts and self.expert_intermediate > 0
                                 and 0 < self.moe_layers <= self.layers):
            raise ValueError("ModelShape: an MoE model needs 0 < top_k <= experts, "
                             "expert_intermediate > 0 and 0 < moe_layers <= layers")
        if self.weight_bytes < 0:
            raise ValueError(f"ModelShape.weight_bytes must be >= 0, got {self.weight_bytes}")

    # -- derived -----------------------------------------------------------------------------
    @property
    def wbytes(self) -> float:
        """Bytes per weight read."""
        return self.weight_bytes or float(self.dtype_bytes)

    @property
    def n_attention(self) -> int:
        return self.attention_layers or (self.layers if not self.mamba_layers else 0)

    @property
    def n_mlp(self) -> int:
        """Layers with an MLP (dense or MoE)."""
        return self.mlp_layers or (self.layers if not self.mamba_layers else 0)

    @property
    def n_norms(self) -> int:
        """Pre-norms: two per transformer layer, one per hybrid block; and the final norm."""
        return (self.layers if self.mamba_layers else 2 * self.layers) + 1

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kind(self) -> str:
        """'hybrid', 'moe' or 'dense': the architecture class reports group by."""
        return "hybrid" if self.mamba_layers else "moe" if self.experts else "dense"

    # -- from a Hugging Face config ----------------------------------------------------------
    @classmethod
    def from_hf_config(
        cls, cfg: Mapping[str, Any], dtype_bytes: int, tp: int = 1, pp: int = 1, dp: int = 1,
        ep: int = 1,
    ) -> ModelShape:
        """From a Hugging Face config dict (its text config for a multimodal model). Raises
        `ShapeError` naming the field when a needed one is missing or malformed; settings the
        formulas do not model (e.g. an unknown quantization) are approximated and noted."""
        return _parse(cfg, dtype_bytes, tp, pp, dp, ep)


def _need(cfg: Mapping[str, Any], *names: str) -> int:
    for name in names:
        value = cfg.get(name)
        if value is not None:
            try:
                out = int(value)
            except (TypeError, ValueError):
                raise ShapeError(f"config field {name!r} is {value!r}, expected an integer") \
                    from None
            if out <= 0:
                raise ShapeError(f"config field {name!r} is {out}, expected a positive integer")
            return out
    raise ShapeError(f"config has no {' or '.join(repr(n) for n in names)}")


def _opt(cfg: Mapping[str, Any], *names: str) -> int:
    for name in names:
        value = cfg.get(name)
        if value is not None:
            try:
                return max(0, int(value))
            except (TypeError, ValueError):
                raise ShapeError(f"config field {name!r} is {value!r}, expected an integer") \
                    from None
    return 0


def weight_bytes_of(cfg: Mapping[str, Any], dtype_bytes: int, notes: list[str]) -> float:
    """Bytes per weight from `quantization_config` (0: none, the activation dtype's)."""
    q = cfg.get("quantization_config")
    if not q:
        return 0.0
    if not isinstance(q, Mapping):
        notes.append("quantization_config is not a mapping: weights priced at the activation "
                     "dtype")
        return 0.0
    method = str(q.get("quant_method", "")).lower()
    if method in _WEIGHT_BYTES_BY_METHOD:
        return _WEIGHT_BYTES_BY_METHOD[method]
    bits = q.get("bits") or q.get("num_bits") or q.get("weight_bits")
    groups = q.get("config_groups")
    if bits is None and isinstance(groups, Mapping):  # compressed-tensors
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping) and weights.get("num_bits"):
                bits = weights["num_bits"]
                break
    if bits is not None:
        try:
            b = float(bits)
        except (TypeError, ValueError):
            b = 0.0
        if 1 <= b <= 16:
            return b / 8 + (0.16 / 8 if b < 8 else 0.0)
    notes.append(f"quantization_config.quant_method {method or '(none)'!r} is not known: "
                 "weights priced at the activation dtype")
    return 0.0


def _hybrid_pattern(cfg: Mapping[str, Any], layers: int) -> tuple[int, int, int] | None:
    """(mamba, attention, mlp) block counts of a Nemotron-H style `hybrid_override_pattern`
    (M: Mamba-2, *: attention, -: MLP), or of a `layers_block_type` list."""
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        if set(pattern) - set("M*-E"):
            raise ShapeError(f"config field 'hybrid_override_pattern' has unknown block kinds "
                             f"{sorted(set(pattern) - set('M*-E'))} (known: M, *, -)")
        if "E" in pattern:
            raise ShapeError("config field 'hybrid_override_pattern' has MoE blocks (E), "
                             "which the formulas do not price yet")
        return pattern.count("M"), pattern.count("*"), pattern.count("-")
    kinds = cfg.get("layers_block_type")
    if isinstance(kinds, list) and kinds:
        names = [str(k).lower() for k in kinds]
        return (sum(k == "mamba" for k in names), sum(k == "attention" for k in names),
                sum(k == "mlp" for k in names))
    return None


def _parse(cfg: Mapping[str, Any], dtype_bytes: int, tp: int, pp: int, dp: int, ep: int
           ) -> ModelShape:
    if not isinstance(cfg, Mapping):
        raise ShapeError(f"config is a {type(cfg).__name__}, expected a mapping")
    notes: list[str] = []
    model_type = str(cfg.get("model_type", "")).lower()
    hidden = _need(cfg, "hidden_size", "d_model", "n_embd")
    heads = _need(cfg, "num_attention_heads", "n_head")
    layers = _need(cfg, "num_hidden_layers", "n_layer")
    vocab = _need(cfg, "vocab_size")
    kv_heads = _opt(cfg, "num_key_value_heads") or heads
    head_dim = _opt(cfg, "head_dim") or max(1, hidden // heads)
    intermediate = _opt(cfg, "intermediate_size_mlp", "intermediate_size", "ffn_dim",
                        "n_inner") or 4 * hidden
    kw: dict[str, Any] = {}

    # Mixture of experts, by its several namings.
    experts = _opt(cfg, "num_local_experts", "num_experts", "n_routed_experts")
    if experts:
        top_k = _opt(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_top_k",
                     "experts_per_token")
        if not top_k:
            raise ShapeError("config names experts but no 'num_experts_per_tok' (top-k)")
        width = _opt(cfg, "moe_intermediate_size") or _opt(cfg, "intermediate_size")
        if not width:
            raise ShapeError("config names experts but no 'moe_intermediate_size' or "
                             "'intermediate_size'")
        shared = _opt(cfg, "shared_expert_intermediate_size")
        if not shared and _opt(cfg, "n_shared_experts"):
            shared = _opt(cfg, "n_shared_experts") * width  # DeepSeek: n shared experts
        if model_type.startswith("llama4"):
            shared = shared or _opt(cfg, "intermediate_size")  # Llama 4: one shared expert
        dense_first = _opt(cfg, "first_k_dense_replace")
        step = _opt(cfg, "interleave_moe_layer_step", "decoder_sparse_step") or 1
        moe_layers_list = cfg.get("moe_layers")
        if isinstance(moe_layers_list, list) and moe_layers_list:
            moe_layers = len(moe_layers_list)
        else:
            moe_layers = sum(1 for i in range(dense_first, layers) if (i + 1) % step == 0)
        sparse_skip = cfg.get("mlp_only_layers")
        if isinstance(sparse_skip, list):
            moe_layers -= sum(1 for i in sparse_skip if 0 <= int(i) < layers)
        if moe_layers <= 0:
            raise ShapeError("config names experts but no layer is an MoE layer "
                             "(first_k_dense_replace / interleave_moe_layer_step)")
        if not (cfg.get("intermediate_size_mlp") or dense_first or moe_layers < layers):
            intermediate = width  # no dense MLP layer: keep the dense width meaningful
        kw.update(experts=experts, top_k=min(top_k, experts), expert_intermediate=width,
                  shared_intermediate=shared, moe_layers=moe_layers)
        if "router_aux_loss_coef" not in cfg and model_type not in (
                "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3",
                "llama4_text", "llama4", "qwen3_vl_moe_text", "qwen3_omni_moe_text"):
            notes.append(f"MoE of model_type {model_type!r} read by its field names")

    # Multi-head latent attention (DeepSeek-V2/V3).
    kv_lora = _opt(cfg, "kv_lora_rank")
    if kv_lora:
        rope = _opt(cfg, "qk_rope_head_dim")
        nope = _opt(cfg, "qk_nope_head_dim")
        v = _opt(cfg, "v_head_dim")
        if not (rope and nope and v):
            raise ShapeError("config has 'kv_lora_rank' (MLA) but not all of "
                             "'qk_rope_head_dim', 'qk_nope_head_dim', 'v_head_dim'")
        kw.update(kv_lora_rank=kv_lora, q_lora_rank=_opt(cfg, "q_lora_rank"), qk_nope_dim=nope,
                  qk_rope_dim=rope, v_head_dim=v)
        head_dim = nope + rope

    # Mamba-2 hybrids.
    pattern = _hybrid_pattern(cfg, layers)
    if pattern is not None and pattern[0]:
        mamba, attention, mlp = pattern
        m_heads = _need(cfg, "mamba_num_heads")
        m_dim = _need(cfg, "mamba_head_dim")
        kw.update(mamba_layers=mamba, attention_layers=attention, mlp_layers=mlp,
                  mamba_heads=m_heads, mamba_head_dim=m_dim,
                  mamba_groups=_opt(cfg, "n_groups", "mamba_n_groups") or 1,
                  mamba_state=_need(cfg, "ssm_state_size", "mamba_d_state"),
                  mamba_conv=_opt(cfg, "conv_kernel", "mamba_d_conv") or 4)
        if attention + mamba + mlp != layers:
            notes.append(f"hybrid pattern has {attention + mamba + mlp} blocks, "
                         f"num_hidden_layers {layers}")
        layers = max(layers, attention + mamba + mlp)
    elif "mamba" in model_type or ("ssm_state_size" in cfg and pattern is None):
        raise ShapeError(f"model_type {model_type!r} has state-space layers but no "
                         "'hybrid_override_pattern' or 'layers_block_type' to place them")

    kw["weight_bytes"] = weight_bytes_of(cfg, dtype_bytes, notes)
    if model_type == "gpt_oss" and not kw["weight_bytes"]:
        kw["weight_bytes"] = _WEIGHT_BYTES_BY_METHOD["mxfp4"]  # its experts ship in MXFP4
    return ModelShape(
        hidden=hidden, intermediate=int(intermediate), layers=layers, heads=heads,
        kv_heads=kv_heads, head_dim=int(head_dim), vocab=vocab, dtype_bytes=dtype_bytes,
        gated_mlp=model_type not in _UNGATED_MODEL_TYPES and cfg.get("hidden_act") != "relu2",
        tp=tp, pp=pp, dp=dp, ep=max(1, ep), notes=tuple(notes), **kw)


def weight_bytes_of_precision(precision: str) -> float:
    """Bytes per weight for a precision name as datasets print it ('bfloat16', 'fp8', ...)."""
    key = precision.strip().lower()
    if key not in _WEIGHT_BYTES_BY_PRECISION:
        raise ShapeError(f"weight precision {precision!r} is not known (known: "
                         f"{', '.join(_WEIGHT_BYTES_BY_PRECISION)})")
    return _WEIGHT_BYTES_BY_PRECISION[key]
