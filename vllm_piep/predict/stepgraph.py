"""One engine step in one onnxruntime call: features, prediction and the split among requests.

The serve path's whole per-step arithmetic is a single ONNX graph, built once per process
from the predictor's constants (the prior's coefficients or a calibrated bundle's leaves), so
the engine loop pays one `InferenceSession.run` per step, with no Python loop over modules or
requests. Inputs are what the scheduler already holds as lists:

- `sched` [4, N]: per scheduled request, tokens already computed before the step (`start`),
  tokens scheduled now (`n`), output tokens so far (`outs`) and the rows of logits it draws
  if the step reaches the end of its known tokens (`draws`: 1 + speculative tokens);
- `prompt` [1, N]: each request's prompt length;
- `seconds` [1, 1]: the step's wall time.

In the graph, per request (PIE-P's execution features, `flops.FEATURES`): prompt tokens in
the step `pre = max(min(start + n, prompt) - start, 0)` (cached prefix tokens are already in
`start`, so they cost no prefill), attended pairs `n * (start + (n + 1) / 2)`, context
`start`, sampled rows (`draws` when the step reaches the end of the known tokens), and
each request's share of the step's tokens and sampled rows. The step's energy per component
comes from the per-feature sums (`leaf_weights`: affine leaves, clamped at zero, summed into
components), plus static power times the step time; a prior's busy power (`BusyPower`: the
power above idle while kernels run, from the step's work at peak rates, its time and its
request count) is spread over the components but static in proportion to their energy. Each
component is then split among the requests by their work (`work_key`), static energy equally
(every request in the batch holds the devices for the whole step: a time share); a tiny
positive work on every request makes a component that nobody's work explains split equally, so
every column always adds up. The output rows are per request: prefill joules, decode joules (a
request's step energy split by its prompt tokens' share of its tokens), then the components.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from vllm_piep.model.components import COMPONENTS, INDEX, STATIC
from vllm_piep.model.flops import (
    FEATURES,
    ModelShape,
    StepBatch,
    expert_read_fraction,
    work_coefficients,
)

# Rows of the per-request feature block, then the same rows as shares of the step's sums.
BASE_ROWS: tuple[str, ...] = ("tokens", "attended_pairs", "context", "sampled_rows", "one",
                              "prefill")
GRAPH_FEATURES: tuple[str, ...] = (*BASE_ROWS, *(f"{r}_share" for r in BASE_ROWS))
ROW_OF: dict[str, int] = {name: i for i, name in enumerate(GRAPH_FEATURES)}
# `flops.FEATURES` (the prior's work formulas) in this layout.
FLOPS_FEATURE_ROWS: tuple[int, ...] = tuple(
    ROW_OF[{"token_share": "tokens_share", "row_share": "sampled_rows_share",
            "requests": "one"}.get(f, f)]
    for f in FEATURES)
# The per-feature sums over a step's requests: what an affine leaf reads.
SUM_OF = {name: ROW_OF[name] for name in ("tokens", "attended_pairs", "context",
                                           "sampled_rows", "one")}
ROWS_SAMPLED = ROW_OF["sampled_rows_share"]  # its sum is 1 if any row is sampled, else 0
# What the graph returns per request, in this order (the engine keeps running totals in it).
OUTPUT_FIELDS = ("prefill", "decode", *COMPONENTS)
N_OUT = len(OUTPUT_FIELDS)
_EPS_WORK = 1e-200  # equal split where no request has work: J * 1e200 / n cannot overflow
_TINY = 1e-300


@dataclass(frozen=True)
class BusyPower:
    """The power a step's GPUs draw above idle while their kernels run (the prior's part that
    follows load): with K the step's work at the GPUs' peak rates (GPU-seconds: `time_key` .
    the feature sums, plus an MoE model's routed-expert reads at their read fraction),

        busy = min(devices * T, K / eta)                  GPU-seconds with kernels running
        joules = busy * (run_watts + occupancy_watts * N / (N + devices * n_half))

    with N the tokens the step computes (the rows of its matrix products: a decoding
    request's one, a prefill's whole chunk, so that a long prompt fills the GPU as a large
    decode batch does); the joules are spread over the step's components in proportion
    to their energy (static aside), so each request's share follows its work."""

    time_key: np.ndarray  # [len(GRAPH_FEATURES)] GPU-seconds at peak per unit of a feature's sum
    expert_seconds: float  # an MoE model's routed-expert reads when every expert is read
    eta: float  # the share of its busy time a GPU spends at its roofline rate
    devices: float
    run_watts: float  # per GPU, above idle, while kernels run
    occupancy_watts: float  # per GPU, reached as the tokens per GPU grow past n_half
    n_half: float

    def __post_init__(self) -> None:
        if self.time_key.shape != (len(GRAPH_FEATURES),) or not (
                np.isfinite(self.time_key).all() and (self.time_key >= 0).all()):
            raise ValueError("busy power's time key must be finite and non-negative")
        scalars = (self.expert_seconds, self.eta, self.devices, self.run_watts,
                   self.occupancy_watts, self.n_half)
        if not all(np.isfinite(scalars)) or min(scalars) < 0 or self.eta <= 0:
            raise ValueError(f"busy power's constants must be finite and non-negative, eta > 0: "
                             f"{scalars}")


# A step whose components have no energy gets no busy energy (it would have nothing to ride on).
_DYNAMIC_FLOOR = 1e-30


def busy_joules(busy: BusyPower, work: float, tokens: float, seconds: float) -> float:
    """A step's busy energy: `work` its GPU-seconds at peak (`time_key` . its feature sums and
    their presence, plus `expert_seconds` times the share of routed experts it reads),
    `tokens` how many tokens it computes, `seconds` its time."""
    gpu_seconds = min(busy.devices * max(seconds, 0.0), work / busy.eta)
    occupancy = tokens / (tokens + busy.devices * busy.n_half)
    return gpu_seconds * (busy.run_watts + busy.occupancy_watts * occupancy)


def add_busy(joules: np.ndarray, busy_j: float) -> None:
    """`busy_j` spread over a step's components ([C], in place) in proportion to their energy,
    static aside (as the step graph does). The components other than static are summed, not
    the whole less static: a step's static energy can be 1e12 times its dynamic energy, whose
    digits a difference would lose."""
    dynamic = max(float(joules[:STATIC].sum() + joules[STATIC + 1:].sum()), _DYNAMIC_FLOOR)
    static = joules[STATIC]
    joules *= 1.0 + busy_j / dynamic
    joules[STATIC] = static


@dataclass(frozen=True)
class StepGraphSpec:
    """The constants of a step graph.

    work_key: [len(GRAPH_FEATURES), C] each request's work per component per unit feature.
    leaf_weights: [len(GRAPH_FEATURES), M], leaf_bias [M]: each leaf's energy as an affine
      function of the per-feature sums over the step's requests (clamped at zero).
    leaf_component: [M] the component each leaf's energy belongs to.
    static_watts: static power of all devices (times the step time: static energy).
    expert_read: (miss, joules): an MoE model's routed-expert weight reads, `joules` when every
      expert is read; a step of T tokens reads 1 - miss**T of them (`flops.expert_read_fraction`)
      into the MLP component. (1, 0): none.
    busy: the power above idle while kernels run (`BusyPower`); None: none.
    """

    work_key: np.ndarray
    leaf_weights: np.ndarray
    leaf_bias: np.ndarray
    leaf_component: np.ndarray
    static_watts: float
    expert_read: tuple[float, float] = (1.0, 0.0)
    busy: BusyPower | None = None

    def __post_init__(self) -> None:
        f, c = len(GRAPH_FEATURES), len(COMPONENTS)
        m = len(self.leaf_bias)
        if self.work_key.shape != (f, c) or self.leaf_weights.shape != (f, m) or (
                self.leaf_component.shape != (m,)):
            raise ValueError("step graph constants have inconsistent shapes")
        if not (np.isfinite(self.work_key).all() and (self.work_key >= 0).all()):
            raise ValueError("work keys must be finite and non-negative")
        if not (np.isfinite(self.leaf_weights).all() and np.isfinite(self.leaf_bias).all()
                and np.isfinite(self.static_watts) and self.static_watts >= 0):
            raise ValueError("leaf weights and static power must be finite")


class LeafConstants(NamedTuple):
    """The leaves as one affine map of the step's sums (and its time), and their components."""

    weights: np.ndarray  # [M + 1, F + 1]: the leaves, then static power times the step time
    bias: np.ndarray  # [M + 1, 1]
    assign: np.ndarray  # [C, M + 1]: each leaf's component
    expert: np.ndarray  # [C, 1]: an MoE step's routed-expert reads when every expert is read


def leaf_constants(spec: StepGraphSpec) -> LeafConstants:
    m = len(spec.leaf_bias)
    weights = np.zeros((m + 1, len(GRAPH_FEATURES) + 1))
    weights[:m, :-1] = spec.leaf_weights.T
    weights[m, -1] = spec.static_watts
    assign = np.zeros((len(COMPONENTS), m + 1))
    assign[spec.leaf_component, np.arange(m)] = 1.0
    assign[STATIC, m] = 1.0
    expert = np.zeros((len(COMPONENTS), 1))
    expert[INDEX["mlp"]] = spec.expert_read[1]
    return LeafConstants(weights, np.append(spec.leaf_bias, 0.0)[:, None], assign, expert)


def raw_inputs(batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
    """The graph's (`sched`, `prompt`) for a `StepBatch`: the same per-request work exactly."""
    a = batch.array
    pre, dec, ctx, rows = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    sched = np.empty((4, len(a)))
    sched[0] = ctx
    sched[1] = pre + dec
    sched[2] = np.where(rows > 0, dec, dec + 1.0)  # end reaches prompt + outs iff sampled
    sched[3] = np.maximum(rows, 1.0)
    return sched, (ctx + pre)[None, :]


def build_model(spec: StepGraphSpec):  # type: ignore[no-untyped-def]
    """The ONNX model (float64 throughout: the split must add up to 1e-9)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes: list = []
    inits: list = []

    def const(name: str, value: np.ndarray | float) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=np.float64), name))
        return name

    def op(kind: str, inputs: list[str], output: str, **attrs: object) -> str:
        nodes.append(helper.make_node(kind, inputs, [output], **attrs))
        return output

    # Few nodes: onnxruntime's cost per node, not the arithmetic, is the step's cost here.
    tiny = const("c_tiny", _TINY)
    nodes.append(helper.make_node("Split", ["sched", const_i64(inits, "split4", [1, 1, 1, 1])],
                                  ["start", "n", "outs", "draws"], axis=0))
    # end = start + n; mid = start + (n + 1) / 2, so attended pairs = n * mid.
    op("Gemm", [const("end_mid_w", np.array([[1.0, 1.0, 0.0, 0.0], [1.0, 0.5, 0.0, 0.0]])),
                "sched", const("end_mid_b", np.array([[0.0], [0.5]]))], "end_mid")
    nodes.append(helper.make_node("Split", ["end_mid", const_i64(inits, "split2", [1, 1])],
                                  ["end", "mid"], axis=0))
    op("Relu", [op("Sub", [op("Min", ["end", "prompt"], "end_in_prompt"), "start"],
                   "pre_raw")], "pre")
    reaches = op("Cast", [op("GreaterOrEqual", ["end", op("Add", ["prompt", "outs"], "known")],
                             "reaches_b")], "reaches", to=TensorProto.DOUBLE)
    op("Mul", [reaches, "draws"], "rows")
    op("Mul", ["n", "mid"], "pairs")
    op("Div", ["n", "n"], "ones")  # n >= 1 for every scheduled request
    op("Concat", ["n", "pairs", "start", "rows", "ones", "pre"], "base", axis=0)
    op("ReduceSum", ["base", const_i64(inits, "ax1", [1])], "base_sum", keepdims=1)
    op("Div", ["base", op("Max", ["base_sum", tiny], "base_sum_pos")], "shares")
    op("Concat", ["base", "shares"], "feat", axis=0)  # [F, N]
    # Per request work per component (+ a tiny equal work: see module docstring).
    op("Gemm", [const("work_key_t", spec.work_key.T),
                "feat", const("eps", np.full((len(COMPONENTS), 1), _EPS_WORK))], "work")
    op("ReduceSum", ["feat", "ax1"], "feat_sum", keepdims=1)  # [F, 1]
    op("Concat", ["feat_sum", "seconds"], "sums", axis=0)  # [F + 1, 1]
    # The leaves, plus one for static power times the step time.
    leaves = leaf_constants(spec)
    op("Relu", [op("Gemm", [const("leaf_w_t", leaves.weights), "sums",
                            const("leaf_b", leaves.bias)], "leaf_raw")], "leaf")
    component_j = "step_joules" if spec.busy is None else "component_j"
    # MoE only (dense graphs keep their node count): the routed-expert reads cost energy, or
    # busy time, or both (a fit with no energy per byte still has their busy time).
    moe = spec.expert_read[1] > 0.0 or (spec.busy is not None and spec.busy.expert_seconds > 0.0)
    if moe:
        op("MatMul", [const("assign", leaves.assign), "leaf"], "leaf_joules")
        tokens = op("Gather", ["feat_sum", const_i64(inits, "row0", [0])], "tokens_sum", axis=0)
        unread = op("Pow", [const("expert_miss", spec.expert_read[0]), tokens], "unread")
        expert_j = op("Mul", [const("expert_full", leaves.expert),
                              op("Sub", [const("one_c", 1.0), unread], "read_frac")],
                      "expert_j")
        op("Add", ["leaf_joules", expert_j], component_j)
    else:
        op("MatMul", [const("assign", leaves.assign), "leaf"], component_j)  # [C, 1]
    if spec.busy is not None:
        busy_nodes(spec.busy, moe, const, op, inits)
    op("ReduceSum", ["work", "ax1"], "work_sum", keepdims=1)
    op("Mul", ["work", op("Div", ["step_joules", "work_sum"], "per_work")], "share_j")
    op("ReduceSum", ["share_j", const_i64(inits, "ax0", [0])], "req_j", keepdims=1)
    op("Mul", ["req_j", op("Div", ["pre", "n"], "pre_frac")], "prefill_j")
    op("Sub", ["req_j", "prefill_j"], "decode_j")
    op("Concat", ["prefill_j", "decode_j", "share_j"], "requests", axis=0)  # [2 + C, N]

    dbl = TensorProto.DOUBLE
    graph = helper.make_graph(
        nodes, "piep_step",
        [helper.make_tensor_value_info("sched", dbl, [4, "N"]),
         helper.make_tensor_value_info("prompt", dbl, [1, "N"]),
         helper.make_tensor_value_info("seconds", dbl, [1, 1])],
        [helper.make_tensor_value_info("requests", dbl, [N_OUT, "N"]),
         helper.make_tensor_value_info("step_joules", dbl, [len(COMPONENTS), 1])],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9,
                             producer_name="vllm_piep")


def busy_nodes(busy: BusyPower, moe: bool, const, op, inits: list) -> None:  # type: ignore[no-untyped-def]
    """`step_joules` from `component_j`: the busy energy (`busy_joules`) spread over the
    components, static aside (`add_busy`)."""
    work = op("MatMul", [const("time_key", busy.time_key[None, :]), "feat_sum"], "work_s")
    if moe:
        work = op("Add", [work, op("Mul", [const("expert_s", busy.expert_seconds), "read_frac"],
                                   "expert_work_s")], "work_all_s")
    gpu_seconds = op("Min", [op("Mul", [const("devices", busy.devices), "seconds"], "held_s"),
                             op("Div", [work, const("eta", busy.eta)], "kernel_s")], "busy_s")
    tokens = op("Gather", ["feat_sum", const_i64(inits, "row_tokens", [ROW_OF["tokens"]])],
                "step_tokens", axis=0)
    occupancy = op("Div", [tokens, op("Add", [tokens, const(
        "half_full", busy.devices * busy.n_half)], "tokens_half")], "occupancy")
    watts = op("Add", [const("run_w", busy.run_watts),
                       op("Mul", [const("occupancy_w", busy.occupancy_watts), occupancy],
                          "occupancy_watts")], "busy_w")
    busy_j = op("Mul", [gpu_seconds, watts], "busy_j")
    dynamic_mask = np.ones((1, len(COMPONENTS)))
    dynamic_mask[0, STATIC] = 0.0
    dynamic = op("Max", [op("MatMul", [const("dynamic_mask", dynamic_mask), "component_j"],
                            "dynamic_raw"), const("dynamic_floor", _DYNAMIC_FLOOR)], "dynamic")
    extra = op("Mul", [const("dynamic_col", dynamic_mask.T),
                       op("Div", [busy_j, dynamic], "busy_per_j")], "busy_extra")
    op("Mul", ["component_j", op("Add", [const("one_col", 1.0), extra], "busy_factor")],
       "step_joules")


def const_i64(inits: list, name: str, value: list[int]) -> str:
    from onnx import numpy_helper

    if not any(i.name == name for i in inits):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=np.int64), name))
    return name


class StepGraph:
    """A built step graph and its onnxruntime session (one per process, one thread)."""

    def __init__(self, spec: StepGraphSpec) -> None:
        import onnxruntime as ort

        self.spec = spec
        opts = ort.SessionOptions()
        # The engine loop calls this between vLLM's own work: one thread, no spinning pool
        # that would compete with vLLM's threads.
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(build_model(spec).SerializeToString(), opts,
                                            providers=["CPUExecutionProvider"])
        self._outputs = ["requests", "step_joules"]
        self._seconds = np.zeros((1, 1))

    def run(self, sched: np.ndarray, prompt: np.ndarray, seconds: float
            ) -> tuple[np.ndarray, np.ndarray]:
        """(per request [2 + C, N]: prefill J, decode J, components; step joules [C])."""
        self._seconds[0, 0] = seconds if seconds > 0.0 else 0.0
        requests, joules = self.session.run(
            self._outputs, {"sched": sched, "prompt": prompt, "seconds": self._seconds})
        return requests, joules[:, 0]

    def run_batch(self, batch: StepBatch, seconds: float) -> tuple[np.ndarray, np.ndarray]:
        sched, prompt = raw_inputs(batch)
        return self.run(sched, prompt, seconds)


# An MoE step's routed-expert reads are split by token share as if the step had this many
# tokens (the split needs one linear key; the step's total uses its real token count).
EXPERT_SPLIT_TOKENS = 64.0


def work_key(shape: ModelShape, joules_per_flop: float, joules_per_byte: float,
             joules_per_link_byte: float, expert_split: bool = True) -> np.ndarray:
    """[GRAPH_FEATURES, C]: each request's work per component, weighed into energy by the
    device's coefficients (the prior's roofline); synchronization wait follows the request's
    collective traffic, static energy its presence in the batch (the `one` row). An MoE
    model's routed-expert reads enter by token share at `EXPERT_SPLIT_TOKENS` unless
    `expert_split` is False (the prior's leaves, which price them apart)."""
    co = work_coefficients(shape)
    per_feature = (joules_per_flop * co.flops + joules_per_byte * co.mem_bytes
                   + joules_per_link_byte * co.link_bytes)
    key = np.zeros((len(GRAPH_FEATURES), len(COMPONENTS)))
    key[list(FLOPS_FEATURE_ROWS)] = per_feature
    if expert_split and co.expert_bytes_full:
        key[ROW_OF["tokens_share"], INDEX["mlp"]] += joules_per_byte * co.expert_bytes_full * \
            float(expert_read_fraction(shape, EXPERT_SPLIT_TOKENS))
    comm = [INDEX[c] for c in ("allreduce", "p2p", "allgather", "alltoall")]
    key[:, INDEX["sync_wait"]] = key[:, comm].sum(axis=1)
    key[:, STATIC] = 0.0
    key[ROW_OF["one"], STATIC] = 1.0
    return key
