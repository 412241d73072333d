"""The predictor interface: one call per engine step, for the whole batch.

The analytic prior implements it now; the calibrated ONNX bundle implements it later. The
serve path never depends on which one it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from vllm_piep.flops import StepBatch

Source = Literal["prior", "calibrated"]


@dataclass(frozen=True)
class StepInput:
    """What the serve path knows about one engine step."""

    batch: StepBatch
    step_seconds: float  # wall time of the step as the engine saw it


@dataclass(frozen=True)
class StepEnergy:
    """A predicted step.

    joules: energy of the whole step per component (`COMPONENTS` order), all devices together.
    work: non-negative key per request (rows) and component (columns) by which each
      component's energy is split among the step's requests.
    work_is_split: the predictor already split by work: `work` holds each request's joules
      and its columns sum to `joules` (the split then only validates it).
    """

    joules: np.ndarray
    work: np.ndarray
    work_is_split: bool = False


@runtime_checkable
class Predictor(Protocol):
    source: Source
    bundle_id: str  # names the coefficients or the bundle that produced the numbers

    def predict_step(self, step: StepInput) -> StepEnergy: ...
