"""The rule that splits a step's energy among its requests, in plain numpy: the reference every
fast path is held to (the ONNX step graph, `ManySteps`, `SeparableSteps`, the engine core's
closed form for runs of decode steps, `runtime/engine_core/decode_runs.py`).

A step graph's split is linear in each request's own features given the step: with `base(r)`
the request's `BASE_ROWS` (tokens, attended pairs, context, sampled rows, one, prefill tokens)
and `S` their sums over the step's requests, request r's joules of component c are

    share_c(r) = A[c] . base(r),   A[c, f] = (J_c / W_c) * (K[f, c] + K[f + 6, c] / S_f)

where `K` is the work key (`StepGraphSpec.work_key`: per unit of a feature, then per unit of its
share of the step's sum), `J_c` the step's energy of component c (the leaves: affine in the
sums, clamped at zero, plus static power times the step's time and an MoE model's expert reads,
then a prior's busy power spread over the components but static in proportion to their energy,
`stepgraph.BusyPower`)
and `W_c` the step's total work of c (every request's work plus a tiny equal work, so that a
component nobody's work explains is split equally). `coefficients` gives A and J for a step's
sums; `shares` applies A; `split` is a whole step, as `StepGraph.run` returns it. A request's
prefill joules are its joules times its prompt tokens' share of its tokens; the rest is decode.

Decode steps: a request decoding one token from context `s` has base = U + s * V with U = (1, 1,
0, 1, 1, 0) and V = (0, 1, 1, 0, 0, 0), so its joules over a run of steps are sums of A . U and
A . V over the run (`decode_terms`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vllm_piep.predict.stepgraph import (
    _EPS_WORK,
    _TINY,
    BASE_ROWS,
    GRAPH_FEATURES,
    N_OUT,
    StepGraphSpec,
    add_busy,
    busy_joules,
    leaf_constants,
)

F = len(BASE_ROWS)
TOKENS, PAIRS, CONTEXT, ROWS, ONE, PREFILL = range(F)
# A one-token decode step from context s: base = DECODE_U + s * DECODE_V.
DECODE_U = np.array([1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
DECODE_V = np.array([0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
assert len(GRAPH_FEATURES) == 2 * F


class StepSplit(NamedTuple):
    """One step's split: per component c and base feature f, the joules a request gets per
    unit of its feature (`per_feature`, [C, F]), and the step's joules per component ([C])."""

    per_feature: np.ndarray
    joules: np.ndarray


def base_features(sched: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """[F, N] each request's `BASE_ROWS` from the scheduler's numbers (`stepgraph`'s inputs:
    `sched` [4, N] start, scheduled, outputs so far, draws; `prompt` [N])."""
    start, n, outs, draws = sched
    end = start + n
    base = np.empty((F, sched.shape[1]))
    base[TOKENS] = n
    np.multiply(n, start + (n + 1.0) * 0.5, out=base[PAIRS])
    base[CONTEXT] = start
    np.multiply(end >= prompt + outs, draws, out=base[ROWS])
    base[ONE] = 1.0
    np.maximum(np.minimum(end, prompt) - start, 0.0, out=base[PREFILL])
    return base


class SplitRule:
    """A step graph's split rule (module docstring), from its constants."""

    def __init__(self, spec: StepGraphSpec) -> None:
        key = spec.work_key
        c = key.shape[1]
        self.n_components = c
        # Every request's tiny equal work rides on its `one` feature.
        self.key_base_t = np.ascontiguousarray(key[:F].T)  # [C, F]
        self.key_base_t[:, ONE] += _EPS_WORK
        self.key_share_t = np.ascontiguousarray(key[F:].T)  # [C, F]
        self.key_t = np.ascontiguousarray(np.hstack([self.key_base_t, self.key_share_t]))
        leaves = leaf_constants(spec)
        self.leaf_weights = leaves.weights  # [M + 1, 2F + 1]
        self.leaf_bias = leaves.bias[:, 0]
        self.assign = leaves.assign  # [C, M + 1]
        self.expert = leaves.expert[:, 0]
        self.expert_miss = spec.expert_read[0]
        self.moe = spec.expert_read[1] > 0.0 or (
            spec.busy is not None and spec.busy.expert_seconds > 0.0)  # as the graph
        self.busy = spec.busy
        self._decode = _DecodeSteps(self)

    def coefficients(self, sums: np.ndarray, seconds: float) -> StepSplit:
        """A step's split from its requests' feature sums ([F]) and its time."""
        x = np.empty(2 * F + 1)
        x[:F] = sums
        np.greater(sums, 0.0, out=x[F:2 * F])
        x[-1] = seconds if seconds > 0.0 else 0.0  # NaN -> 0, as the graph
        joules = self.assign @ np.maximum(self.leaf_weights @ x + self.leaf_bias, 0.0)
        read = 1.0 - self.expert_miss ** sums[TOKENS] if self.moe else 0.0
        if self.moe:
            joules += self.expert * read
        if self.busy is not None:
            work = float(self.busy.time_key @ x[:2 * F]) + self.busy.expert_seconds * read
            add_busy(joules, busy_joules(self.busy, work, float(sums[TOKENS]), float(x[-1])))
        ratio = joules / (self.key_t @ x[:2 * F])
        inv = np.divide(x[F:2 * F], np.maximum(sums, _TINY))  # 1 / S where present, else 0
        per_feature = self.key_share_t * inv
        per_feature += self.key_base_t
        per_feature *= ratio[:, None]
        return StepSplit(per_feature, joules)

    def decode_step(self, requests: int, context: float, seconds: float
                    ) -> tuple[np.ndarray, np.ndarray] | None:
        """A step of `requests` one-token decodes whose contexts sum to `context` and nothing
        else: its decode terms ([C, 2], `decode_terms`) and joules ([C]), in fewer operations
        than `coefficients`; None where the contexts are all 0 (then use `coefficients`)."""
        return self._decode.run(requests, context, seconds)

    def split(self, sched: np.ndarray, prompt: np.ndarray, seconds: float
              ) -> tuple[np.ndarray, np.ndarray]:
        """A whole step as `StepGraph.run` gives it: ([N_OUT, N] per request: prefill J,
        decode J, components; [C] step joules)."""
        base = base_features(sched, prompt)
        step = self.coefficients(base.sum(axis=1), seconds)
        requests = np.empty((N_OUT, base.shape[1]))
        requests[2:] = step.per_feature @ base
        phases(requests, base)
        return requests, step.joules


class _DecodeSteps:
    """`SplitRule.coefficients` and `decode_terms` folded for steps of one-token decodes only:
    with d requests and contexts summing to e, the sums are d U + e V and every feature but
    prefill is present, so the leaves, the work and the terms are small matrices times
    (d, e, seconds, 1) and (1/d, 1/(d + e), 1/e)."""

    def __init__(self, rule: SplitRule) -> None:
        present = np.ones(F)
        present[PREFILL] = 0.0
        w = rule.leaf_weights
        # Leaves at (d, e, seconds, 1).
        self.leaves = np.column_stack([w[:, :F] @ DECODE_U, w[:, :F] @ DECODE_V, w[:, -1],
                                       w[:, F:2 * F] @ present + rule.leaf_bias])
        kb, ks = rule.key_base_t, rule.key_share_t
        self.work = np.column_stack([kb @ DECODE_U, kb @ DECODE_V, ks @ present])  # (d, e, 1)
        # The terms: (A.U, A.V) / ratio = base part + share part at (1/d, 1/(d + e), 1/e).
        self.terms_base = np.column_stack([kb @ DECODE_U, kb @ DECODE_V])  # [C, 2]
        share = np.zeros((rule.n_components, 2, 3))
        share[:, 0, 0] = ks[:, TOKENS] + ks[:, ROWS] + ks[:, ONE]
        share[:, 0, 1] = ks[:, PAIRS]
        share[:, 1, 1] = ks[:, PAIRS]
        share[:, 1, 2] = ks[:, CONTEXT]
        self.terms_share = share
        self.assign = rule.assign
        self.rule = rule
        # The busy power's work at peak at (d, e, 1).
        tk = np.zeros(2 * F) if rule.busy is None else rule.busy.time_key
        self.busy_work = (float(tk[:F] @ DECODE_U), float(tk[:F] @ DECODE_V),
                          float(tk[F:] @ present))
        self._x = np.empty(4)
        self._q = np.empty(3)

    def run(self, d: int, e: float, seconds: float) -> tuple[np.ndarray, np.ndarray] | None:
        if e <= 0.0 or d <= 0:
            return None
        x = self._x
        x[0], x[1], x[2], x[3] = d, e, seconds if seconds > 0.0 else 0.0, 1.0
        rule = self.rule
        joules = self.assign @ np.maximum(self.leaves @ x, 0.0)
        read = 1.0 - rule.expert_miss ** d if rule.moe else 0.0
        if rule.moe:
            joules += rule.expert * read
        busy = rule.busy
        if busy is not None:
            kd, ke, k1 = self.busy_work
            work = kd * d + ke * e + k1 + busy.expert_seconds * read
            add_busy(joules, busy_joules(busy, work, float(d), float(x[2])))
        ratio = joules / (self.work @ x[[0, 1, 3]])
        q = self._q
        q[0], q[1], q[2] = 1.0 / d, 1.0 / (d + e), 1.0 / e
        terms = self.terms_share @ q
        terms += self.terms_base
        terms *= ratio[:, None]
        return terms, joules


def phases(requests: np.ndarray, base: np.ndarray) -> None:
    """Rows 0 and 1 of `requests` ([N_OUT, N], components from row 2): each request's joules
    split into prefill (its prompt tokens' share of its tokens) and decode."""
    total = requests[2:].sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        np.multiply(total, base[PREFILL] / base[TOKENS], out=requests[0])
    np.subtract(total, requests[0], out=requests[1])


_UV = np.ascontiguousarray(np.column_stack([DECODE_U, DECODE_V]))


def decode_terms(per_feature: np.ndarray) -> np.ndarray:
    """[C, 2]: (A . U, A . V), a one-token decode step's joules per component at context 0,
    and per token of context (module docstring)."""
    return per_feature @ _UV
