"""The split rule (`split_rule.py`) as plain Python made from one predictor's constants: what the
engine core runs every step, without a numpy call.

`split_rule.SplitRule` is the reference, in numpy: a step's split is, per component c and base
feature f, `A[c, f] = (J_c / W_c) (K[f, c] + K[f + 6, c] / S_f)` applied to each request's
features. numpy's cost per call, not its arithmetic, decides what that costs on a step's dozen
numbers, so `PythonSplit` writes the same arithmetic out as Python source when the predictor
loads: its constants as literals, only the components that can have energy (`live`) and only
the non-zero terms, no loops but the one over a step's explicit requests. The source is
compiled once (`exec`) and checked against `SplitRule` on random steps (`check`); where they
disagree, the engine does not use it (`make_python_split` returns None and says why).

Shapes, as the engine keeps them (`live` of the components, `L` of them):
- a request's base features: `(tokens, attended pairs, context, sampled rows, prefill)`
  (`base`; the sixth, `one`, is 1 for every request);
- a share: `(prefill J, decode J, J of each live component)`;
- decode terms: `(A.U of each live component, A.V of each live component)`: a one-token decode
  step from context s gives a request `A.U + s A.V` (`split_rule.decode_terms`).

`explicit(bases, extras, d, e, seconds, keep)`: a step of the explicit requests `bases` and `d`
requests in runs of one-token decodes whose contexts sum to `e`, some of which compute more
than one token (speculative tokens): `extras`, each one's features beyond a one-token decode's
(`extra`). Returns the explicit requests' shares then the extras' (all decode), the step's
decode terms (the runs' part), its joules per live component, in all, and its static joules.
`decode(d, e, seconds, keep)`: a step of the runs alone (`e > 0`): its terms and joules. `keep`
scales the static part of every share and term (warm-up takes the rest); the joules are the
step's, warm-up included.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from vllm_piep.model.components import COMPONENTS, INDEX, STATIC
from vllm_piep.once import logger
from vllm_piep.predict.split_rule import ONE, TOKENS, F, SplitRule, base_features, decode_terms
from vllm_piep.predict.stepgraph import _DYNAMIC_FLOOR, _TINY

Base = tuple[float, float, float, float, float]  # tokens, pairs, context, rows, prefill
# Which of the graph's six base features each position of `Base` is (`one` is implicit).
_BASE_FEATURES = (0, 1, 2, 3, 5)
_MLP = INDEX["mlp"]
# A one-token decode from context s: base features U + s V (`split_rule.DECODE_U/V`).
_U = (1.0, 1.0, 0.0, 1.0, 1.0, 0.0)
_V = (0.0, 1.0, 1.0, 0.0, 0.0, 0.0)
CHECK_STEPS = 64  # random steps `check` compares with the reference
CHECK_RTOL = 1e-9


def base(start: float, n: float, outs: float, draws: float, prompt: float) -> Base:
    """A request's base features from the scheduler's numbers (`split_rule.base_features`)."""
    end = start + n
    pre = (min(prompt, end)) - start
    return (n, n * (start + (n + 1.0) * 0.5), start, draws if end >= prompt + outs else 0.0,
            max(0.0, pre))


Extra = tuple[float, float, float]  # tokens, attended pairs, sampled rows


def extra(context: float, n: float, draws: float) -> Extra:
    """A run member's features beyond a one-token decode's (`U + context V`) in a step that
    schedules it `n` tokens from `context`, sampling `draws` rows: its speculative tokens."""
    return (n - 1.0, n * (context + (n + 1.0) * 0.5) - 1.0 - context, draws - 1.0)


class PythonSplit:
    """A `SplitRule` as generated Python (module docstring)."""

    def __init__(self, rule: SplitRule) -> None:
        self.rule = rule
        self.live = live_components(rule)
        self.static_at = self.live.index(STATIC)  # the static component's place in a share
        self.source = _Writer(rule, self.live).source()
        namespace: dict[str, Any] = {}
        exec(compile(self.source, f"<split rule: {len(self.live)} components>", "exec"),
             namespace)
        self.explicit: Callable[..., tuple[list[tuple[float, ...]], tuple[float, ...],
                                           tuple[float, ...], float, float]] = namespace[
            "explicit"]
        self.decode: Callable[..., tuple[tuple[float, ...], tuple[float, ...], float, float]
                              ] = namespace["decode"]

    def full(self, share: Sequence[float]) -> list[float]:
        """A share as the record's fields (prefill, decode, every component)."""
        out = [0.0] * (2 + len(COMPONENTS))
        out[0], out[1] = share[0], share[1]
        for k, c in enumerate(self.live):
            out[2 + c] = share[2 + k]
        return out

    def check(self, seed: int = 0, steps: int = CHECK_STEPS) -> str | None:
        """The generated code against the reference on random steps (prefills, decodes,
        speculative and preempted requests, runs of decodes, warm-up): None where every
        share, term and joule agrees to `CHECK_RTOL`, else what differs."""
        rng = random.Random(seed)
        rule = self.rule
        for k in range(steps):
            n_req = rng.randint(0 if k % 4 else 1, 12)
            cols = [_random_request(rng) for _ in range(n_req)]
            d = rng.choice((0, 0, rng.randint(1, 300)))
            e = float(rng.randint(1, 10_000) * d)
            if not cols and not d:
                d, e = 1, 100.0
            seconds = rng.choice((0.0, -1.0, float("nan"), rng.uniform(1e-4, 0.5)))
            keep = rng.choice((1.0, 1.0, rng.random()))
            spec = [(float(rng.randint(1, 4000)), float(n), float(n))
                    for n in (rng.randint(2, 5) for _ in range(rng.randint(0, min(d, 4))))]
            where = (f"step {k} ({n_req} explicit, {d} in runs, {len(spec)} of them with "
                     f"speculative tokens, {seconds} s, keep {keep})")
            problem = self._check_step(rule, cols, spec, d, e, seconds, keep, where)
            if problem:
                return problem
        return None

    def _check_step(self, rule: SplitRule, cols: list[tuple[float, ...]],
                    spec: list[tuple[float, float, float]], d: int, e: float, seconds: float,
                    keep: float, where: str) -> str | None:
        bases = [base(*col) for col in cols]
        extras = [extra(*member) for member in spec]
        shares, terms, joules, total, static = self.explicit(bases, extras, d, e, seconds,
                                                             keep)
        deltas = np.array([[x[0], x[1], 0.0, x[2], 0.0, 0.0] for x in extras]).reshape(-1, F)
        sums = np.array([d, d + e, e, d, d, 0.0]) + deltas.sum(axis=0)
        if cols:
            sched = np.array([c[:4] for c in cols], dtype=np.float64).T
            prompt = np.array([c[4] for c in cols], dtype=np.float64)
            want_base = base_features(sched, prompt)
            sums = sums + want_base.sum(axis=1)
        ref = rule.coefficients(sums, seconds)
        per_feature = ref.per_feature.copy()
        per_feature[STATIC] *= keep
        live = list(self.live)
        scale = float(np.abs(ref.joules).sum()) + 1e-300
        if not _close(joules, ref.joules[live], scale) or not math.isclose(
                total, float(ref.joules.sum()), rel_tol=CHECK_RTOL, abs_tol=1e-300):
            return f"{where}: joules {joules} against {ref.joules[live].tolist()}"
        if not math.isclose(static, float(ref.joules[STATIC]), rel_tol=CHECK_RTOL,
                            abs_tol=1e-300):
            return f"{where}: static joules {static} against {ref.joules[STATIC]}"
        dead = [c for c in range(len(COMPONENTS)) if c not in self.live]
        if np.abs(ref.joules[dead]).max(initial=0.0) > 0.0:
            return f"{where}: a component taken for dead has energy {ref.joules.tolist()}"
        want_terms = decode_terms(per_feature)
        if not _close(terms, [*want_terms[live, 0], *want_terms[live, 1]],
                      float(np.abs(want_terms).max()) + 1e-300):
            return f"{where}: decode terms {terms} against {want_terms[live].T.tolist()}"
        if len(shares) != len(cols) + len(extras):
            return f"{where}: {len(shares)} shares for {len(cols) + len(extras)} requests"
        if cols:
            comps = per_feature @ want_base  # [C, N]
            total_r = comps.sum(axis=0)
            with np.errstate(invalid="ignore", divide="ignore"):
                pre = total_r * (want_base[5] / want_base[0])
            for i, share in enumerate(shares[:len(cols)]):
                want = [pre[i], total_r[i] - pre[i], *comps[live, i]]
                if not _close(share, want, scale):
                    return f"{where}: request {i}'s share {share} against {want}"
        for i, share in enumerate(shares[len(cols):]):
            comps_x = per_feature @ deltas[i]
            want = [0.0, float(comps_x.sum()), *comps_x[live]]
            if not _close(share, want, scale):
                return f"{where}: speculative member {i}'s extra share {share} against {want}"
        if d and e > 0:  # the runs alone, folded, against the same step explicitly
            folded = self.decode(d, e, seconds, keep)
            _, terms, joules, total, static = self.explicit([], [], d, e, seconds, keep)
            if not (_close(folded[0], terms, float(np.abs(terms).max()) + 1e-300)
                    and _close(folded[1], joules, float(np.abs(joules).sum()) + 1e-300)
                    and math.isclose(folded[2], total, rel_tol=CHECK_RTOL, abs_tol=1e-300)
                    and math.isclose(folded[3], static, rel_tol=CHECK_RTOL, abs_tol=1e-300)):
                return f"{where}: the decode step {folded} against {(terms, joules)}"
        return None


def _random_request(rng: random.Random) -> tuple[float, ...]:
    """(start, n, outs, draws, prompt) as vLLM's scheduler holds a request."""
    prompt = rng.randint(1, 4096)
    outs = rng.randint(0, 256)
    known = prompt + outs
    kind = rng.choice(("decode", "decode", "chunk", "cached", "recompute", "spec"))
    spec = 0
    if kind == "decode":
        start, n = known - 1, 1
    elif kind == "spec":
        spec = rng.randint(1, 4)
        start, n = known - 1, 1 + spec
    elif kind == "recompute":
        start, n = 0, rng.randint(1, known)
    else:
        outs = 0
        start = rng.randint(1, prompt - 1) if kind == "cached" and prompt > 1 else 0
        n = rng.randint(1, prompt - start)
    return (float(start), float(n), float(outs), float(1 + spec), float(prompt))


def _close(got: Sequence[float], want: Sequence[float], scale: float) -> bool:
    if len(got) != len(want):
        return False
    return all(math.isclose(g, w, rel_tol=CHECK_RTOL, abs_tol=1e-12 * scale)
               or (math.isnan(g) and math.isnan(w)) for g, w in zip(got, want, strict=True))


def live_components(rule: SplitRule) -> tuple[int, ...]:
    """The components whose energy can be non-zero: those a leaf with a non-zero weight or bias
    is assigned to, the MLP of an MoE model (its expert reads), and static energy."""
    leaves = np.abs(rule.leaf_weights).sum(axis=1) + np.abs(rule.leaf_bias) > 0.0
    live = {STATIC}
    for c in range(rule.n_components):
        if np.any((rule.assign[c] != 0.0) & leaves):
            live.add(c)
    if rule.moe and rule.expert[_MLP] != 0.0:
        live.add(_MLP)
    return tuple(sorted(live))


def make_python_split(rule: SplitRule) -> PythonSplit | None:
    """The generated split rule, checked against the reference; None (with one warning saying
    why) where it cannot be made or disagrees."""
    try:
        split = PythonSplit(rule)
        problem = split.check()
    except Exception as exc:  # noqa: BLE001  (any fault: the reference serves)
        problem = f"{type(exc).__name__}: {exc}"
    if problem is None:
        return split
    logger.warning("vllm_piep: the split rule's Python form disagrees with its reference (%s); "
                   "every step is predicted whole through the step graph instead",
                   problem if len(problem) <= 300 else problem[:297] + "...")
    return None


def _lit(x: float) -> str:
    """A float as an exact literal."""
    return repr(float(x))


def _sum(terms: list[str]) -> str:
    return " + ".join(terms) if terms else "0.0"


class _Writer:
    """The source of `explicit` and `decode` for one rule (module docstring). Few lines: each
    costs the interpreter about the same, whatever its arithmetic."""

    def __init__(self, rule: SplitRule, live: tuple[int, ...]) -> None:
        self.rule, self.live = rule, live
        self.kb = rule.key_base_t  # [C, F], the tiny equal work on `one` included
        self.ks = rule.key_share_t  # [C, F]

    def source(self) -> str:
        return "\n".join([*self._explicit(), "", *self._decode(), ""])

    @staticmethod
    def _affine(weights: Sequence[float], presence: Sequence[float] | None, t_weight: float,
                bias: float, extra: Sequence[str] = ()) -> str:
        """`weights` over the sums `s0..s5` then the presence `p0..p5` (folded into the bias
        where `presence` is known), the step time and a bias, as an expression."""
        terms = [f"{_lit(weights[f])} * s{f}" for f in range(F) if weights[f] != 0.0]
        for f in range(F):
            w = float(weights[F + f])
            if w != 0.0:
                if presence is None:
                    terms.append(f"{_lit(w)} * p{f}")
                else:
                    bias += w * presence[f]
        if t_weight != 0.0:
            terms.append(f"{_lit(t_weight)} * t")
        terms.extend(extra)
        if bias != 0.0:
            terms.append(_lit(bias))
        return _sum(terms)

    # -- the step's joules, from its sums `s0..s5`, presence `p0..p5` and time `t` -------------
    def _joules(self, presence: Sequence[float] | None) -> list[str]:
        """Lines that set `j<c>` for every live component, `total` and `static` (the step's
        energy; `presence`: the features' presence where it is known, else variables)."""
        rule = self.rule
        w, b = rule.leaf_weights, rule.leaf_bias
        lines = []
        moe = rule.moe
        if moe:
            lines.append(f"    read = 1.0 - {_lit(rule.expert_miss)} ** s0")
        for c in self.live:
            leaves = np.flatnonzero(rule.assign[c]).tolist()
            parts = []
            for m in leaves:
                expr = self._affine(w[m, :2 * F], presence, float(w[m, 2 * F]), float(b[m]))
                # Sums, presence and time are never negative: a leaf of no negative constant
                # needs no clamp.
                if (w[m] < 0.0).any() or b[m] < 0.0:
                    lines += [f"    l{m} = {expr}", f"    if not l{m} > 0.0:",
                              f"        l{m} = 0.0"]
                    expr = f"l{m}"
                weight = float(rule.assign[c, m])
                parts.append(expr if weight == 1.0 else f"{_lit(weight)} * ({expr})")
            if moe and c == _MLP and rule.expert[_MLP] != 0.0:
                parts.append(f"{_lit(rule.expert[_MLP])} * read")
            lines.append(f"    j{c} = {_sum(parts)}")
        busy = rule.busy
        if busy is not None:
            extra = [f"{_lit(busy.expert_seconds)} * read"] if moe and busy.expert_seconds \
                else []
            devices = float(busy.devices)
            dynamic = [c for c in self.live if c != STATIC]
            lines += [
                f"    work = ({self._affine(busy.time_key, presence, 0.0, 0.0, extra)})"
                f" / {_lit(busy.eta)}",
                f"    held = {_lit(devices)} * t",
                f"    factor = (held if held < work else work) * ({_lit(busy.run_watts)} + "
                f"{_lit(busy.occupancy_watts)} * (s{TOKENS} / (s{TOKENS} + "
                f"{_lit(devices * busy.n_half)})))",
                "    dynamic = " + _sum([f"j{c}" for c in dynamic]),
                f"    factor = 1.0 + factor / (dynamic if dynamic > {_lit(_DYNAMIC_FLOOR)} "
                f"else {_lit(_DYNAMIC_FLOOR)})",
                *[f"    j{c} *= factor" for c in dynamic],
            ]
        return lines

    def _ratio(self, c: int, presence: Sequence[float] | None) -> str:
        """Component c's joules per unit of work (static: times `keep`)."""
        work = self._affine([*self.kb[c], *self.ks[c]], presence, 0.0, 0.0)
        keep = " * keep" if c == STATIC else ""
        return f"    r{c} = j{c} / ({work}){keep}"

    def _coefficient(self, c: int, f: int) -> str | None:
        """A(c, f) as an expression of `r<c>` and `i<f>` (1 / s<f>, or 0 where absent); None
        where it is 0."""
        kb, ks = float(self.kb[c, f]), float(self.ks[c, f])
        if kb == 0.0 and ks == 0.0:
            return None
        if ks == 0.0:
            return f"r{c} * {_lit(kb)}"
        if kb == 0.0:
            return f"r{c} * {_lit(ks)} * i{f}"
        return f"r{c} * ({_lit(kb)} + {_lit(ks)} * i{f})"

    def _returned(self) -> str:
        return "(" + ", ".join(f"j{c}" for c in self.live) + ",), " + _sum(
            [f"j{c}" for c in self.live]) + f", j{STATIC}"

    def _explicit(self) -> list[str]:
        live = self.live
        coeff = {(c, f): self._coefficient(c, f) for c in live for f in range(F)}
        lines = [
            "def explicit(bases, extras, d, e, seconds, keep):",
            "    s0 = s3 = s4 = d",
            "    s1 = d + e",
            "    s2 = e",
            "    s5 = 0.0",
            "    if extras:",
            "        x0, x1, x3 = map(sum, zip(*extras))",
            "        s0 += x0",
            "        s1 += x1",
            "        s3 += x3",
            "    if bases:",
            "        b0, b1, b2, b3, b5 = map(sum, zip(*bases))",
            "        s0 += b0",
            "        s1 += b1",
            "        s2 += b2",
            "        s3 += b3",
            "        s4 += len(bases)",
            "        s5 += b5",
            *[f"    p{f} = 1.0 if s{f} > 0.0 else 0.0" for f in range(F)],
            *[f"    i{f} = 1.0 / s{f} if s{f} > {_lit(_TINY)} else {_lit(1 / _TINY)} * p{f}"
              for f in range(F)],
            "    t = seconds if seconds > 0.0 else 0.0",
            *self._joules(None),
            *[self._ratio(c, None) for c in live],
            *[f"    a{c}_{f} = {coeff[c, f]}" for c in live for f in range(F)
              if coeff[c, f] is not None],
            "    shares = []",
            "    for n, pairs, ctx, rows, pre in bases:",
        ]
        names = dict(zip((0, 1, 2, 3, ONE, 5), ("n", "pairs", "ctx", "rows", None, "pre"),
                         strict=True))
        for c in live:
            terms = [f"a{c}_{f}" if names[f] is None else f"a{c}_{f} * {names[f]}"
                     for f in range(F) if coeff[c, f] is not None]
            lines.append(f"        c{c} = {_sum(terms)}")
        lines += [
            "        whole = " + _sum([f"c{c}" for c in live]),
            "        first = whole * (pre / n)",
            "        shares.append((first, whole - first, " + ", ".join(f"c{c}" for c in live)
            + ",))",
        ]
        lines.append("    for n, pairs, rows in extras:")
        for c in live:
            terms = [f"a{c}_{f} * {name}" for f, name in ((0, "n"), (1, "pairs"), (3, "rows"))
                     if coeff[c, f] is not None]
            lines.append(f"        c{c} = {_sum(terms)}")
        lines += [
            "        shares.append((0.0, " + _sum([f"c{c}" for c in live]) + ", "
            + ", ".join(f"c{c}" for c in live) + ",))",
        ]
        at_zero = [_sum([f"a{c}_{f}" for f in range(F) if _U[f] and coeff[c, f] is not None])
                   for c in live]
        per_token = [_sum([f"a{c}_{f}" for f in range(F) if _V[f] and coeff[c, f] is not None])
                     for c in live]
        lines.append("    return shares, (" + ", ".join([*at_zero, *per_token]) + ",), "
                     + self._returned())
        return lines

    def _decode(self) -> list[str]:
        """`explicit` without explicit requests, every feature but prefill present (e > 0),
        straight to the terms."""
        presence = (1.0, 1.0, 1.0, 1.0, 1.0, 0.0)
        live = self.live
        kb, ks = self.kb, self.ks
        at_zero, per_token = [], []
        for c in live:
            # A.U = r (kb.U + (ks0 + ks3 + ks4) / d + ks1 / (d + e)); A.V = r (kb.V + ks1 / (d
            # + e) + ks2 / e)
            u = ((float(sum(kb[c, f] for f in range(F) if _U[f])), ""),
                 (float(ks[c, 0] + ks[c, 3] + ks[c, ONE]), " * i0"), (float(ks[c, 1]), " * i1"))
            v = ((float(kb[c, 1] + kb[c, 2]), ""), (float(ks[c, 1]), " * i1"),
                 (float(ks[c, 2]), " * i2"))
            at_zero.append(f"r{c} * ({_sum([_lit(k) + x for k, x in u if k != 0.0])})")
            per_token.append(f"r{c} * ({_sum([_lit(k) + x for k, x in v if k != 0.0])})")
        return [
            "def decode(d, e, seconds, keep):",
            "    s0 = s3 = s4 = d",
            "    s1 = d + e",
            "    s2 = e",
            "    i0 = 1.0 / d",
            "    i1 = 1.0 / s1",
            "    i2 = 1.0 / e",
            "    t = seconds if seconds > 0.0 else 0.0",
            *self._joules(presence),
            *[self._ratio(c, presence) for c in live],
            "    return (" + ", ".join([*at_zero, *per_token]) + ",), " + self._returned(),
        ]
