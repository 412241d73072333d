"""Split a step's predicted energy among the step's requests.

Each component's energy is divided in proportion to each request's work for that component;
a component with energy but no work anywhere is divided equally. Every column of the result
sums to the step's energy for that component, so the requests' energies sum to the step's.
"""

from __future__ import annotations

import numpy as np

from vllm_piep.flops import StepBatch
from vllm_piep.predict.base import StepEnergy


def split_step(step: StepEnergy) -> np.ndarray:
    """Per request (rows) and component (columns) joules; columns sum to `step.joules`."""
    work = np.asarray(step.work, dtype=np.float64)
    joules = np.asarray(step.joules, dtype=np.float64)
    n = work.shape[0]
    if n == 0:
        return np.zeros((0, joules.shape[0]))
    if np.any(work < 0) or not np.all(np.isfinite(work)):
        raise ValueError("work keys must be finite and non-negative")
    if np.any(joules < 0) or not np.all(np.isfinite(joules)):
        raise ValueError(f"predicted step energy must be finite and non-negative: {joules}")
    totals = work.sum(axis=0)
    shares = np.divide(work, totals, out=np.full_like(work, 1.0 / n), where=totals > 0)
    return shares * joules


def phase_split(per_request_joules: np.ndarray, batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
    """Each request's step energy split into prefill and decode by its token counts."""
    total = per_request_joules.sum(axis=1)
    tokens = batch.tokens
    prefill_fraction = np.divide(
        batch.prefill_tokens, tokens, out=np.zeros_like(total), where=tokens > 0
    )
    prefill = total * prefill_fraction
    return prefill, total - prefill
