"""Property tests of the split of a step's energy among its requests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from vllm_piep.model.components import N_COMPONENTS
from vllm_piep.model.flops import StepBatch
from vllm_piep.predict.attribution import prefill_fraction, split_step
from vllm_piep.predict.base import StepEnergy

finite = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def steps(draw: st.DrawFn) -> StepEnergy:
    n = draw(st.integers(min_value=1, max_value=64))
    work = draw(arrays(np.float64, (n, N_COMPONENTS), elements=finite))
    joules = draw(arrays(np.float64, (N_COMPONENTS,), elements=finite))
    return StepEnergy(joules=joules, work=work)


@settings(max_examples=300, deadline=None)
@given(steps())
def test_split_conserves_every_component(step: StepEnergy) -> None:
    per_request = split_step(step)
    assert per_request.shape == step.work.shape
    assert (per_request >= 0).all()
    np.testing.assert_allclose(per_request.sum(axis=0), step.joules, rtol=1e-9, atol=1e-9)
    assert per_request.sum() == pytest.approx(step.joules.sum(), rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(steps())
def test_split_is_proportional_to_work(step: StepEnergy) -> None:
    per_request = split_step(step)
    totals = step.work.sum(axis=0)
    for c in np.flatnonzero(totals > 0):
        expected = step.joules[c] * (step.work[:, c] / totals[c])
        np.testing.assert_allclose(per_request[:, c], expected, rtol=1e-12, atol=1e-12)
    for c in np.flatnonzero(totals == 0):  # nobody did that work: shared equally
        np.testing.assert_allclose(per_request[:, c], step.joules[c] / len(step.work))


def test_split_rejects_negative_or_nan() -> None:
    with pytest.raises(ValueError):
        split_step(StepEnergy(joules=np.ones(N_COMPONENTS), work=-np.ones((2, N_COMPONENTS))))
    with pytest.raises(ValueError):
        split_step(StepEnergy(joules=np.full(N_COMPONENTS, np.nan),
                              work=np.ones((2, N_COMPONENTS))))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 8)), min_size=1, max_size=32))
def test_prefill_fraction_is_the_prompt_tokens_share(tokens: list[tuple[int, int]]) -> None:
    prefill = [p for p, _ in tokens]
    decode = [d for _, d in tokens]
    batch = StepBatch.from_lists(prefill, decode, [0] * len(tokens), [1] * len(tokens))
    fraction = prefill_fraction(batch)
    assert ((fraction >= 0) & (fraction <= 1)).all()
    for f, (p, d) in zip(fraction, tokens, strict=True):
        assert f == (p / (p + d) if p + d else 0.0)
