"""Split a step's predicted energy among the step's requests.

Each component's energy is divided in proportion to each request's work for that component;
a component with energy but no work anywhere is divided equally. Every column of the result
sums to the step's energy for that component, so the requests' energies sum to the step's.
"""

from __future__ import annotations

import math

import numpy as np

from vllm_piep.model.flops import StepBatch
from vllm_piep.predict.base import StepEnergy


def split_step(step: StepEnergy) -> np.ndarray:
    """Per request (rows) and component (columns) joules; columns sum to `step.joules`."""
    work = np.asarray(step.work, dtype=np.float64)
    n = work.shape[0]
    if n == 0:
        return np.zeros((0, len(step.joules)))
    joules = [float(x) for x in step.joules]
    # Few whole-array calls (this runs every step): NaN fails `min() >= 0`, and an infinite
    # entry makes its column total infinite.
    totals = work.sum(axis=0).tolist()
    if not (work.min() >= 0 and all(map(math.isfinite, totals))):
        raise ValueError("work keys must be finite and non-negative")
    if not all(j >= 0 and math.isfinite(j) for j in joules):
        raise ValueError(f"predicted step energy must be finite and non-negative: {joules}")
    if step.work_is_split:
        if not all(math.isclose(t, j, rel_tol=1e-9, abs_tol=1e-12)
                   for t, j in zip(totals, joules, strict=True)):
            raise ValueError("a predictor's own split does not add up to its step energy")
        return work
    if min(totals) <= 0:  # energy nobody's work explains is shared equally
        idle = [t <= 0 for t in totals]
        work = work.copy()
        work[:, idle] = 1.0
        totals = [float(n) if i else t for t, i in zip(totals, idle, strict=True)]
    return (work / np.asarray(totals)) * np.asarray(joules)  # shares first: no overflow


def prefill_fraction(batch: StepBatch) -> np.ndarray:
    """Share of each request's step energy that is prefill: its prompt tokens' share."""
    a = batch.array
    return a[:, 0] / np.maximum(a[:, 0] + a[:, 1], 1.0)
