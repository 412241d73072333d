"""The predictor interface: what the engine core calls.

Every predictor is a `Predictor`: `source`, `bundle_id`, optionally `interval`, and
`predict_step` (a step's energy per component and each request's work key; the engine splits
it, `attribution.split_step`). Any such object can be plugged in (`PIEP_PREDICTOR`). A
predictor whose split is linear in each request's features given the step (`LinearSplit`:
the analytic prior and a calibrated bundle, both `GraphPredictor`s) also gives the engine its
`split_rule()` (`predict.split_rule`): the engine then splits each step itself, requests in
runs of decode steps in closed form, and the ONNX step graph (`predict.stepgraph`) is the
reference it is tested against. The records never depend on which one the engine has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from vllm_piep.meters.common import Source as MeterSource
from vllm_piep.model.flops import StepBatch
from vllm_piep.predict.split_rule import SplitRule
from vllm_piep.predict.stepgraph import StepGraph, StepGraphSpec

# `prior`: the analytic prior; `calibrated`: fitted to a meter that measures; `estimated`,
# `simulated`: fitted to a meter that estimates (the CPU estimate) or simulates.
Source = Literal["prior", "calibrated", "estimated", "simulated"]
# What a predictor fitted to a meter's energy says: a fit to an estimate is an estimate.
_FITTED: dict[MeterSource, Source] = {"measured": "calibrated", "estimated": "estimated",
                                      "simulated": "simulated"}


def fitted_source(meter_source: MeterSource) -> Source:
    """`calibrated` where the meter a predictor was fitted to measures, else the meter's own
    kind (`estimated`, `simulated`)."""
    return _FITTED[meter_source]


def fit_warning(what: str, meter: str, meter_source: MeterSource) -> str | None:
    """The line a tool prints when it fits `what` (a bundle, a correction) to a meter that
    does not measure; None where the meter measures."""
    if meter_source == "measured":
        return None
    return (f"{what} is fitted to {meter}, whose energy is {meter_source}, not measured: "
            f"responses served with it say \"source\": \"{fitted_source(meter_source)}\"")


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


@dataclass(frozen=True)
class Interval:
    """A prediction interval as multipliers of the predicted energy (split-conformal on the
    bundle's held-out residuals), with the coverage measured on held-out data."""

    lower: float
    upper: float
    level: float
    coverage: float | None


@runtime_checkable
class Predictor(Protocol):
    source: Source
    bundle_id: str  # names the coefficients or the bundle that produced the numbers

    def predict_step(self, step: StepInput) -> StepEnergy: ...


@runtime_checkable
class LinearSplit(Predictor, Protocol):
    """A predictor whose split the engine computes itself from its rule (module docstring)."""

    def split_rule(self) -> SplitRule: ...


class GraphPredictor:
    """A predictor whose step (features, prediction, split) is one onnxruntime call."""

    source: Source
    bundle_id: str
    interval: Interval | None = None

    def __init__(self, spec: StepGraphSpec) -> None:
        self.graph = StepGraph(spec)
        self.run_step = self.graph.run  # (sched, prompt, seconds) -> (requests, step joules)

    def split_rule(self) -> SplitRule:
        return SplitRule(self.graph.spec)

    def predict_step(self, step: StepInput) -> StepEnergy:
        requests, joules = self.graph.run_batch(step.batch, step.step_seconds)
        return StepEnergy(joules=joules, work=requests[2:].T, work_is_split=True)
