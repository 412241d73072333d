"""Per-module work (`module_work`) against torch's FLOP counter on tiny Llama and OPT models,
against vLLM's own analytic model (vllm/v1/metrics/perf.py), and against `step_work`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.work_checks import assert_modules_sum_to_step_work

from vllm_piep.model.components import INDEX
from vllm_piep.model.flops import (
    MODULE_COMPONENT,
    ModelShape,
    ModuleWork,
    StepBatch,
    module_kind,
    module_work,
    step_work,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REQUIRED = 0.05  # the tolerance against torch's counter


@pytest.fixture(scope="module")
def opt():
    cfg = transformers.OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=256,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=512, word_embed_proj_dim=64)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    return model, ModelShape.from_hf_config(cfg.to_dict(), dtype_bytes=4)


def _counted(model, **kwargs) -> dict[str, float]:
    """FLOPs per module path, without the class-name prefix ('model.layers.0.mlp')."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(**kwargs)
    return {name.partition(".")[2]: float(sum(ops.values()))
            for name, ops in counter.get_flop_counts().items() if "." in name}


def _run(model, vocab: int, context: int, new: int, logits_to_keep: int = 1) -> dict[str, float]:
    """Count one forward of `new` tokens after `context` tokens already in the KV cache."""
    ids = (torch.arange(3, 3 + context + new) % vocab).unsqueeze(0)
    past = None
    if context:
        with torch.no_grad():
            past = model(input_ids=ids[:, :context], use_cache=True).past_key_values
    return _counted(model, input_ids=ids[:, context:], past_key_values=past,
                    use_cache=past is not None, logits_to_keep=logits_to_keep)


def _eager_masked_pairs(new: int) -> float:
    """Eager attention multiplies each new token's query with every key of the chunk and
    masks the future afterwards: q x (c + q) products, where vLLM's kernels (and our formula)
    compute the causal q*c + q*(q+1)/2. The difference is the q*(q-1)/2 masked pairs."""
    return new * (new - 1) / 2


def _row(context: int, new: int) -> tuple[int, int, int, int]:
    """The StepBatch row of `new` tokens after `context` cached ones, sampling one row."""
    if context and new == 1:
        return (0, 1, context, 1)  # a decode step
    return (new, 0, context, 1)  # a prefill, or a prefill chunk after a cached prefix


def _dev(ours: float, measured: float) -> float:
    return abs(ours - measured) / measured


# (context tokens already cached, new tokens): prefills of 1, 17, 96 and 200 tokens, decode
# steps over a short and a long context, and a prefill chunk after a cached prefix.
CASES = [(0, 1), (0, 17), (0, 96), (0, 200), (17, 1), (300, 1), (40, 16)]


@pytest.mark.parametrize(("context", "new"), CASES)
def test_llama_modules_match_torch_flop_counter(hf_llama, shape: ModelShape, context: int,
                                                new: int) -> None:
    measured = _run(hf_llama, shape.vocab, context, new)
    ours = module_work(shape, StepBatch.from_rows([_row(context, new)]))
    q_dim = shape.heads * shape.head_dim
    kv_dim = shape.kv_heads * shape.head_dim
    masked = 4 * q_dim * _eager_masked_pairs(new)  # QK^T and PV: 2 * 2 * q_dim per pair
    projections = new * (2 * shape.hidden * (q_dim + 2 * kv_dim) + 2 * q_dim * shape.hidden)
    for i in range(shape.layers):
        attn = f"model.layers.{i}.self_attn"
        m_attention = measured[attn]
        m_core = m_attention - sum(measured[f"{attn}.{p}_proj"] for p in "qkvo")
        o_attention = ours[f"layers.{i}.attention"].flops + masked
        assert _dev(o_attention, m_attention) < REQUIRED
        # The attention core alone (the projections are most of the module's FLOPs, so the
        # module-level 5 % would not notice a wrong pair count at small contexts).
        assert _dev(o_attention - projections, m_core) < REQUIRED
        assert _dev(ours[f"layers.{i}.mlp"].flops, measured[f"model.layers.{i}.mlp"]) < REQUIRED
    assert _dev(ours["logits"].flops, measured["lm_head"]) < REQUIRED
    # torch counts matmuls only: the embedding and the norms (4*hidden FLOPs per token each
    # in our count) do not appear, and nothing else outside the layers and the LM head does.
    assert not any("norm" in k or "embed" in k for k in measured)
    total = sum(w.flops for k, w in ours.items() if MODULE_COMPONENT[module_kind(k)] != "norm")
    assert _dev(total + shape.layers * masked, measured["model"] + measured["lm_head"]) < REQUIRED


def test_llama_logits_of_every_row(hf_llama, shape: ModelShape) -> None:
    # logits_to_keep=0: HF computes logits for all 24 rows, as in a prompt-logprobs request.
    measured = _run(hf_llama, shape.vocab, 0, 24, logits_to_keep=0)
    ours = module_work(shape, StepBatch.from_rows([(24, 0, 0, 24)]))
    assert _dev(ours["logits"].flops, measured["lm_head"]) < REQUIRED


@pytest.mark.parametrize(("context", "new"), [(0, 17), (0, 96), (50, 1), (30, 12)])
def test_opt_modules_match_torch_flop_counter(opt, context: int, new: int) -> None:
    model, opt_shape = opt
    assert not opt_shape.gated_mlp
    measured = _run(model, opt_shape.vocab, context, new)
    ours = module_work(opt_shape, StepBatch.from_rows([_row(context, new)]))
    q_dim = opt_shape.heads * opt_shape.head_dim
    h = opt_shape.hidden
    projections = new * 2 * h * (q_dim + 2 * q_dim) + new * 2 * q_dim * h
    for i in range(opt_shape.layers):
        layer = f"model.decoder.layers.{i}"
        m_proj = sum(measured[f"{layer}.self_attn.{p}"]
                     for p in ("q_proj", "k_proj", "v_proj", "out_proj"))
        m_core = measured[f"{layer}.self_attn"] - m_proj
        o_attention = ours[f"layers.{i}.attention"].flops
        assert _dev(projections, m_proj) < REQUIRED
        assert _dev(o_attention, m_proj + m_core - 4 * q_dim * _eager_masked_pairs(new)) \
            < REQUIRED
        # OPT's MLP is two plain matrices, fc1 and fc2, directly in the decoder layer.
        m_mlp = measured[f"{layer}.fc1"] + measured[f"{layer}.fc2"]
        assert _dev(ours[f"layers.{i}.mlp"].flops, m_mlp) < REQUIRED
    assert _dev(ours["logits"].flops, measured["lm_head"]) < REQUIRED


# ---- The modules add up to step_work --------------------------------------------------------

_shapes = st.builds(
    ModelShape,
    hidden=st.integers(8, 8192), intermediate=st.integers(8, 30000),
    layers=st.integers(1, 80), heads=st.sampled_from([1, 2, 4, 8, 32, 64]),
    kv_heads=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([32, 64, 128]),
    vocab=st.integers(100, 200_000), dtype_bytes=st.sampled_from([1, 2, 4]),
    gated_mlp=st.booleans(), tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2]))
_rows = st.lists(st.tuples(st.integers(0, 2048), st.integers(0, 4), st.integers(0, 32768),
                           st.integers(0, 4)), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(shape=_shapes, rows=_rows)
def test_modules_sum_to_step_work(shape: ModelShape, rows) -> None:
    modules, work = assert_modules_sum_to_step_work(shape, StepBatch.from_rows(rows))
    # Link traffic: a ring all-reduce moves 2*(tp-1) payloads over links, a gather tp-1.
    moved = {"all_reduce": 2 * (shape.tp - 1), "gather": shape.tp - 1}
    for kind, component in (("all_reduce", "allreduce"), ("gather", "allgather")):
        link = sum(moved[kind] * w.collective_bytes for w in modules.values()
                   if w.collective == kind)
        assert link == pytest.approx(work.link_bytes[:, INDEX[component]].sum(), rel=1e-9)


def test_module_names_and_parts(shape: ModelShape) -> None:
    modules = module_work(shape, StepBatch.from_rows([(17, 0, 0, 1), (0, 1, 30, 1)]))
    L = shape.layers
    names = list(modules)
    assert names[0] == "embedding" and names[-2:] == ["final_norm", "logits"]
    assert len(modules) == 3 + 4 * L
    assert all(isinstance(w, ModuleWork) and w.activation_bytes >= 0 for w in modules.values())
    assert all(w.kv_bytes == 0 for k, w in modules.items() if module_kind(k) != "attention")
    h, b = shape.hidden, shape.dtype_bytes
    T = 18  # tokens in the step
    assert not any(w.collective for w in modules.values())  # tp == 1: no collectives
    tp2 = module_work(replace(shape, tp=2), StepBatch.from_rows([(17, 0, 0, 1), (0, 1, 30, 1)]))
    reduces = [k for k, w in tp2.items() if w.collective == "all_reduce"]
    assert reduces == ["embedding"] + [f"layers.{i}.{m}" for i in range(L)
                                       for m in ("attention", "mlp")]
    assert all(tp2[k].collective_bytes == T * h * b for k in reduces)
    assert tp2["logits"].collective == "gather"
    assert tp2["logits"].collective_bytes == 2 * shape.vocab * b
    # The KV cache of a decode token over 30 cached ones: write 1 K/V, read 31 K/V per layer.
    kv_dim = shape.kv_heads * shape.head_dim
    decode = module_work(shape, StepBatch.from_rows([(0, 1, 30, 1)]))
    assert decode["layers.0.attention"].kv_bytes == (1 + 31) * 2 * kv_dim * b


@pytest.mark.parametrize("tp", [2, 4])
def test_per_rank_shards_and_replicas(shape: ModelShape, tp: int) -> None:
    batch = StepBatch.from_rows([(40, 0, 8, 1), (0, 1, 100, 1), (0, 1, 7, 1)])
    total = module_work(replace(shape, tp=tp), batch)
    rank = module_work(replace(shape, tp=tp), batch, per_rank=True)
    single = module_work(shape, batch)  # whole-model totals: only the collectives differ
    assert {k: replace(w, collective="", collective_bytes=0.0)
            for k, w in total.items()} == single
    for k in total:
        kind = module_kind(k)
        if kind in ("mlp", "logits"):  # sharded along intermediate / vocab
            assert rank[k].flops * tp == pytest.approx(total[k].flops)
            assert rank[k].weight_bytes * tp == pytest.approx(total[k].weight_bytes)
        elif MODULE_COMPONENT[kind] == "norm":  # replicated
            assert rank[k].flops == total[k].flops and rank[k].bytes == total[k].bytes
    # Attention: query heads are split; the tiny model's 2 KV heads are split at tp=2 and
    # replicated (one per rank) at tp=4.
    T, h, d = 42, shape.hidden, shape.head_dim
    pairs = 40 * 8 + 40 * 41 / 2 + 101 + 8
    q_rank = shape.heads // tp * d
    kv_rank = max(1, shape.kv_heads // tp) * d
    expected = T * (2 * h * (q_rank + 2 * kv_rank) + 2 * q_rank * h) + 4 * q_rank * pairs
    assert rank["layers.0.attention"].flops == pytest.approx(expected)
    assert rank["embedding"].weight_bytes * tp == pytest.approx(total["embedding"].weight_bytes)


# ---- vLLM's analytic model -------------------------------------------------------------------
#
# perf.py's definitions, and where ours differ (asserted below as closed-form differences):
# - attention FLOPs: perf multiplies each request's q new tokens by its whole context_len
#   (cached + new, c + q): the rectangle, masked pairs included, like HF's eager attention.
#   Ours counts the causal q*c + q*(q+1)/2. Same for decode (q = 1).
# - attention bytes: perf counts the attention kernel's read of q and of K/V over c + q, the
#   new K/V written to the cache, the projections' inputs/outputs and weights. Ours adds the
#   attention kernel's output write (q_dim per token) and the cache-write kernel's read of the
#   new k and v (2*kv_dim per token), which perf leaves out.
# - FFN and LM head: identical definitions (perf's dense FFN is always SwiGLU: for an OPT
#   model it would count 3 matrices where there are 2; not compared here).
# - perf has no embedding or norms; perf's logits rows are "one per prefill request plus every
#   decode token", ours are the sampled rows: the batches below sample exactly those rows.

PERF_BATCH = [  # (prefill, decode, context, sampled)
    (17, 0, 0, 1), (64, 0, 100, 1), (1, 0, 0, 1), (0, 1, 31, 1), (0, 1, 500, 1)]


@pytest.fixture(scope="module")
def perf_metrics(tiny_model: Path):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.metrics.perf import ModelMetrics

    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model), dtype="float32"))
    metrics = {m.component_type(): m for m in ModelMetrics(config).metrics}
    assert set(metrics) == {"attn", "ffn", "unembed"}
    return metrics


def _perf_context(rows):
    from vllm.v1.metrics.perf import ExecutionContext

    ctx = ExecutionContext()
    for prefill, decode, context, _ in rows:
        # As ModelMetrics.get_step_perf_stats_per_gpu builds it: context_len includes the
        # tokens of this step.
        ctx.add(prefill + decode, context + prefill + decode, is_prefill=prefill > 0)
    return ctx


def _perf(metric, rows, per_gpu: bool) -> tuple[dict, dict, dict]:
    ctx = _perf_context(rows)
    return (metric.get_num_flops_breakdown(ctx, per_gpu),
            metric.get_read_bytes_breakdown(ctx, per_gpu),
            metric.get_write_bytes_breakdown(ctx, per_gpu))


def _sum(modules: dict[str, ModuleWork], kind: str, field: str) -> float:
    return sum(getattr(w, field) for k, w in modules.items() if module_kind(k) == kind)


@pytest.mark.parametrize("rows", [PERF_BATCH, [r for r in PERF_BATCH if r[1]]],
                         ids=["mixed", "decode_only"])
def test_against_vllm_perf_model(perf_metrics, shape: ModelShape, rows) -> None:
    ours = module_work(shape, StepBatch.from_rows(rows))
    L, b = shape.layers, shape.dtype_bytes
    q_dim = shape.heads * shape.head_dim
    kv_dim = shape.kv_heads * shape.head_dim
    T = sum(p + d for p, d, _, _ in rows)
    masked = sum(_eager_masked_pairs(p + d) for p, d, _, _ in rows)

    flops, read, write = _perf(perf_metrics["attn"], rows, per_gpu=False)
    attention = _sum(ours, "attention", "flops")
    assert attention + L * 4 * q_dim * masked == pytest.approx(sum(flops.values()), rel=1e-9)
    if all(p + d == 1 for p, d, _, _ in rows):  # decode only: the same definition outright
        assert attention == pytest.approx(sum(flops.values()), rel=1e-9)
    q_read = T * q_dim * b * L  # perf's attn_input = this read of q + the K/V reads
    assert _sum(ours, "attention", "weight_bytes") == read["qkv_weight"] + read["out_weight"]
    assert _sum(ours, "attention", "kv_bytes") == pytest.approx(
        write["kv_cache"] + read["attn_input"] - q_read, rel=1e-9)
    perf_act = (read["qkv_input"] + write["qkv_output"] + q_read + read["out_input"]
                + write["out_output"])
    assert _sum(ours, "attention", "activation_bytes") - perf_act == pytest.approx(
        T * (q_dim + 2 * kv_dim) * b * L, rel=1e-9)

    flops, read, write = _perf(perf_metrics["ffn"], rows, per_gpu=False)
    assert _sum(ours, "mlp", "flops") == flops["dense_ffn"]
    weights = read["dense_up_gate_weights"] + read["dense_down_weights"]
    assert _sum(ours, "mlp", "weight_bytes") == weights
    assert _sum(ours, "mlp", "bytes") == sum(read.values()) + sum(write.values())

    flops, read, write = _perf(perf_metrics["unembed"], rows, per_gpu=False)
    assert ours["logits"].flops == flops["unembed"]
    assert ours["logits"].weight_bytes == read["weight"]
    assert ours["logits"].bytes == sum(read.values()) + sum(write.values())


@pytest.mark.parametrize("tp", [2, 4])
def test_per_rank_against_vllm_perf_model(perf_metrics, shape: ModelShape, tp: int) -> None:
    ours = module_work(replace(shape, tp=tp), StepBatch.from_rows(PERF_BATCH), per_rank=True)
    L, q_rank = shape.layers, shape.heads // tp * shape.head_dim
    masked = sum(_eager_masked_pairs(p + d) for p, d, _, _ in PERF_BATCH)
    attn = perf_metrics["attn"].model_copy(update={"tp_size": tp})
    ffn = perf_metrics["ffn"].model_copy(update={"ffn_tp_size": tp})
    unembed = perf_metrics["unembed"].model_copy(update={"tp_size": tp})

    flops, read, _ = _perf(attn, PERF_BATCH, per_gpu=True)
    assert _sum(ours, "attention", "flops") + L * 4 * q_rank * masked == pytest.approx(
        sum(flops.values()), rel=1e-9)
    assert _sum(ours, "attention", "weight_bytes") == read["qkv_weight"] + read["out_weight"]
    flops, read, write = _perf(ffn, PERF_BATCH, per_gpu=True)
    assert _sum(ours, "mlp", "flops") == flops["dense_ffn"]
    assert _sum(ours, "mlp", "bytes") == sum(read.values()) + sum(write.values())
    flops, read, write = _perf(unembed, PERF_BATCH, per_gpu=True)
    assert ours["logits"].flops == flops["unembed"]
    assert ours["logits"].bytes == sum(read.values()) + sum(write.values())


def test_step_work_matches_perf_model_total(perf_metrics, shape: ModelShape) -> None:
    # The hot-path matrix form against perf.py, over the components both count.
    work = step_work(shape, StepBatch.from_rows(PERF_BATCH))
    ctx = _perf_context(PERF_BATCH)
    perf_flops = sum(m.get_num_flops(ctx, per_gpu=False) for m in perf_metrics.values())
    masked = sum(_eager_masked_pairs(p + d) for p, d, _, _ in PERF_BATCH)
    q_dim = shape.heads * shape.head_dim
    ours = work.flops[:, [INDEX["attention"], INDEX["mlp"], INDEX["logits"]]].sum()
    assert ours + shape.layers * 4 * q_dim * masked == pytest.approx(perf_flops, rel=1e-9)
    assert np.isfinite(work.mem_bytes).all()
