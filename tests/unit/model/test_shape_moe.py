"""MoE, MLA, hybrid and quantized shapes: read from Hugging Face configs, checked against the
published parameter counts of `model_structures.csv`, against torch's FLOP counter on tiny
random MoE models, and for the split's invariants in the served step graph."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.paths import PUBLISHED_DATA
from support.work_checks import assert_modules_sum_to_step_work

from vllm_piep.calibrate.published import hf_config
from vllm_piep.model.components import INDEX, STATIC
from vllm_piep.model.devices import GPU_SPECS, DeviceProfile
from vllm_piep.model.flops import (
    ModelShape,
    ShapeError,
    StepBatch,
    expert_read_fraction,
    parameter_counts,
    step_work,
)
from vllm_piep.predict.prior import PriorPredictor

STRUCTURES = PUBLISHED_DATA / "model_structures.csv"

MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}
QWEN2_MOE = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
             "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
             "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
             "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4,
             "decoder_sparse_step": 1, "mlp_only_layers": []}
GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
           "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "vocab_size": 201088, "num_local_experts": 32,
           "experts_per_token": 4, "quantization_config": {"quant_method": "mxfp4"}}
LLAMA4_MAVERICK = {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
                   "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
                   "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 202048, "num_local_experts": 128, "num_experts_per_tok": 1,
                   "interleave_moe_layer_step": 2}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
               "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
               "quantization_config": {"quant_method": "fp8"}}
NEMOTRON_H = {"model_type": "nemotron_h", "hidden_size": 5120, "intermediate_size": 20480,
              "num_hidden_layers": 62, "num_attention_heads": 40, "num_key_value_heads": 8,
              "head_dim": 128, "vocab_size": 131072, "mamba_num_heads": 128,
              "mamba_head_dim": 80, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
              "hidden_act": "relu2",
              "hybrid_override_pattern": "M-" * 22 + "M*-" * 6}  # 12B-v2: 28 M, 6 *, 28 -


def test_families_read_from_their_configs() -> None:
    mixtral = ModelShape.from_hf_config(MIXTRAL, 2)
    assert (mixtral.kind, mixtral.experts, mixtral.top_k, mixtral.expert_intermediate,
            mixtral.moe_layers, mixtral.shared_intermediate) == ("moe", 8, 2, 14336, 32, 0)
    qwen = ModelShape.from_hf_config(QWEN2_MOE, 2)
    assert (qwen.experts, qwen.top_k, qwen.expert_intermediate, qwen.shared_intermediate) == (
        60, 4, 1408, 5632)
    oss = ModelShape.from_hf_config(GPT_OSS, 2)
    assert oss.top_k == 4 and oss.wbytes == pytest.approx(4.25 / 8)
    maverick = ModelShape.from_hf_config(LLAMA4_MAVERICK, 2)
    # Every second layer is MoE (128 experts, top-1, shared expert of the expert width); the
    # others dense of `intermediate_size_mlp`.
    assert (maverick.moe_layers, maverick.intermediate, maverick.shared_intermediate) == (
        24, 16384, 8192)
    ds = ModelShape.from_hf_config(DEEPSEEK_V3, 2)
    assert ds.is_mla and ds.moe_layers == 58 and ds.intermediate == 18432
    assert ds.shared_intermediate == 2048 and ds.wbytes == 1.0 and ds.head_dim == 192
    hybrid = ModelShape.from_hf_config(NEMOTRON_H, 2)
    pattern = NEMOTRON_H["hybrid_override_pattern"]
    assert (hybrid.kind, hybrid.mamba_layers, hybrid.n_attention, hybrid.n_mlp) == (
        "hybrid", pattern.count("M"), pattern.count("*"), pattern.count("-"))
    assert not hybrid.gated_mlp  # ReLU^2: up and down only


@pytest.mark.parametrize(("cfg", "field"), [
    ({**MIXTRAL, "num_experts_per_tok": None}, "num_experts_per_tok"),
    ({**DEEPSEEK_V3, "v_head_dim": None}, "v_head_dim"),
    ({**NEMOTRON_H, "hybrid_override_pattern": "MX*"}, "hybrid_override_pattern"),
    ({**NEMOTRON_H, "mamba_num_heads": None}, "mamba_num_heads"),
    ({**MIXTRAL, "hidden_size": "wide"}, "hidden_size"),
    ({**MIXTRAL, "num_attention_heads": 0}, "num_attention_heads"),
    ({k: v for k, v in MIXTRAL.items() if k != "vocab_size"}, "vocab_size"),
])
def test_a_config_it_cannot_read_names_the_field(cfg: dict, field: str) -> None:
    with pytest.raises(ShapeError, match=field):
        ModelShape.from_hf_config(cfg, 2)


def test_unknown_quantization_is_priced_at_the_dtype_and_said() -> None:
    shape = ModelShape.from_hf_config({**MIXTRAL, "quantization_config": {
        "quant_method": "someday-q3"}}, 2)
    assert shape.wbytes == 2.0 and "someday-q3" in shape.notes[0]
    spec = GPU_SPECS["h100-sxm5-80gb"]
    prior = PriorPredictor(shape, DeviceProfile.from_spec(spec, 2))
    assert "someday-q3" in prior.bundle_id  # the response's bundle says it was approximated
    compressed = ModelShape.from_hf_config({**MIXTRAL, "quantization_config": {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": {"num_bits": 8}}}}}, 2)
    assert compressed.wbytes == 1.0 and not compressed.notes


def _structure_rows() -> list[dict]:
    table = pd.read_csv(STRUCTURES)
    return [r for r in table.to_dict("records")
            if r["confidence"] != "low" and np.isfinite(r["hidden_size"])]


def test_weights_the_formulas_read_are_the_published_parameter_counts() -> None:
    """model_structures.csv counts every model's parameters from its config (its README: MLA,
    first dense layers, interleaved MoE, shared experts, Mamba-2 blocks); the formulas' weight
    reads, summed the same way, must give the same totals and active counts."""
    rows = _structure_rows()
    kinds = set()
    for r in rows:
        shape = ModelShape.from_hf_config(hf_config(r), 2)
        kinds.add(shape.kind)
        total, active = parameter_counts(shape, str(r["tie_word_embeddings"]).lower() == "true")
        assert total / 1e9 == pytest.approx(r["total_params_b"], rel=0.005), r["model_id"]
        assert active / 1e9 == pytest.approx(r["active_params_b"], rel=0.005), r["model_id"]
    assert kinds == {"dense", "moe", "hybrid"}


# ---- FLOPs against torch's counter on tiny random MoE models --------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("tokens", [1, 9, 64])
def test_moe_flops_match_torch_flop_counter(family: str, tokens: int) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=96, num_local_experts=8,
                                         num_experts_per_tok=2, **common)
        model_cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=48,
                                          shared_expert_intermediate_size=80, num_experts=6,
                                          num_experts_per_tok=2, decoder_sparse_step=1,
                                          **common)
        model_cls = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(0)
    # Eager experts: one matmul per expert over its routed tokens (the default grouped kernel
    # is invisible to the counter).
    model = model_cls._from_config(cfg, attn_implementation="eager",
                                   experts_implementation="eager").eval()
    shape = ModelShape.from_hf_config(cfg.to_dict(), dtype_bytes=4)
    assert shape.is_moe
    ids = (torch.arange(3, 3 + tokens) % 256).unsqueeze(0)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(input_ids=ids, use_cache=False)
    measured = counter.get_total_flops()
    # As for the dense check: logits for every row, a context making the causal pairs equal
    # eager attention's full square.
    work = step_work(shape, StepBatch.from_lists([tokens], [0], [(tokens - 1) / 2], [tokens]))
    ours = work.flops[0, [INDEX["attention"], INDEX["mlp"], INDEX["logits"]]].sum()
    # Qwen2-MoE's shared-expert gate (hidden -> 1 per token) is the formula's one omission.
    gate = 2 * shape.hidden * tokens * shape.layers if family == "qwen2_moe" else 0
    assert ours == pytest.approx(measured - gate, rel=1e-9)


def test_expert_weights_read_grow_with_tokens_until_all_are_read() -> None:
    shape = ModelShape.from_hf_config(MIXTRAL, 2)
    assert expert_read_fraction(shape, 1) == pytest.approx(2 / 8)
    assert expert_read_fraction(shape, 4096) == pytest.approx(1.0)
    mlp = INDEX["mlp"]
    one = step_work(shape, StepBatch.from_rows([(0, 1, 100, 1)])).mem_bytes[:, mlp].sum()
    eight = step_work(shape, StepBatch.from_rows([(0, 1, 100, 1)] * 8)).mem_bytes[:, mlp].sum()
    prefill = step_work(shape, StepBatch.from_rows([(2048, 0, 0, 1)])).mem_bytes[:, mlp].sum()
    assert one < eight < 8 * one  # weights shared, more experts read
    expert_bytes = 8 * 3 * shape.hidden * shape.expert_intermediate * 2 * shape.moe_layers
    assert prefill > expert_bytes  # a long prefill reads every expert


# ---- Modules and the served step graph ------------------------------------------------------

_moe_shapes = st.builds(
    lambda experts, k, width, shared, tp, ep, mla, layers: ModelShape(
        hidden=256, intermediate=512, layers=layers, heads=8, kv_heads=2, head_dim=32,
        vocab=1000, dtype_bytes=2, tp=tp, experts=experts, top_k=min(k, experts),
        expert_intermediate=width, shared_intermediate=shared, moe_layers=layers - 1 or 1,
        ep=ep, **(dict(kv_lora_rank=64, q_lora_rank=96, qk_nope_dim=32, qk_rope_dim=16,
                       v_head_dim=32) if mla else {})),
    st.sampled_from([4, 16, 128]), st.integers(1, 8), st.integers(8, 512),
    st.sampled_from([0, 128]), st.sampled_from([1, 2]), st.sampled_from([1, 4]), st.booleans(),
    st.integers(1, 6))
_hybrid = ModelShape.from_hf_config(NEMOTRON_H, 2)
_rows = st.lists(st.tuples(st.integers(0, 512), st.integers(0, 2), st.integers(0, 4096),
                           st.integers(0, 2)), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(shape=st.one_of(_moe_shapes, st.just(_hybrid)), rows=_rows)
def test_moe_mla_hybrid_modules_sum_to_step_work(shape: ModelShape, rows) -> None:
    assert_modules_sum_to_step_work(shape, StepBatch.from_rows(rows))


H100 = DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], 2)
# A fit with no energy per byte (one `fit-prior` can give): the experts' reads cost no energy
# of their own but still keep the GPUs busy.
NO_BYTE_ENERGY = replace(H100, joules_per_byte=0.0, joules_per_flop=1e-12)


@settings(max_examples=60, deadline=None)
@given(shape=st.one_of(_moe_shapes, st.just(_hybrid)), rows=_rows,
       seconds=st.floats(1e-4, 1.0), profile=st.sampled_from([H100, NO_BYTE_ENERGY]))
def test_prior_graph_prices_moe_steps_as_the_formulas_and_conserves(
        shape: ModelShape, rows, seconds: float, profile: DeviceProfile) -> None:
    """The graph's nonlinear expert-read term equals step_work's, in the energy per byte and
    in the busy time, and the requests' split adds up to the step in every component."""
    rows = [r if r[0] + r[1] > 0 else (r[0], 1, r[2], r[3]) for r in rows]
    batch = StepBatch.from_rows(rows)
    prior = PriorPredictor(replace(shape, tp=1, ep=1) if shape.ep > 1 and shape.tp > 1
                           else shape, profile)
    requests, step = prior.graph.run_batch(batch, seconds)
    work = step_work(prior.shape, batch)
    dynamic = (profile.joules_per_flop * work.flops + profile.joules_per_byte * work.mem_bytes
               + profile.joules_per_link_byte * work.link_bytes).sum(axis=0)
    dynamic[INDEX["sync_wait"]] = 0.0
    dynamic[STATIC] = 0.0
    # Busy power: the step's work at peak rates (expert reads at their read fraction, as
    # step_work counts them) over eta, at most the GPUs' time, spread over the components.
    at_peak = (profile.seconds_per_flop * work.flops.sum()
               + profile.seconds_per_byte * (work.mem_bytes.sum() + 2 * work.link_bytes.sum())
               + profile.seconds_per_link_byte * work.link_bytes.sum())
    # Occupancy by the tokens the step computes (a prefill's chunk fills the GPU as a batch).
    g, n = prior.devices, float(batch.prefill_tokens.sum() + batch.decode_tokens.sum())
    busy = min(g * seconds, at_peak / profile.eta) * (
        profile.run_watts + profile.occupancy_watts * n / (n + g * profile.n_half))
    dynamic *= 1.0 + busy / dynamic.sum()
    dynamic[STATIC] = profile.static_watts * prior.devices * seconds
    np.testing.assert_allclose(step, dynamic, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(requests[2:].sum(axis=1), step, rtol=1e-9, atol=1e-15)
