"""Predictors injected into a real server through PIEP_PREDICTOR to test the error boundary."""

from __future__ import annotations

from typing import Any

from vllm_piep.predict.base import StepEnergy, StepInput


class RaisingPredictor:
    source = "prior"
    bundle_id = "test/raising"

    def predict_step(self, step: StepInput) -> StepEnergy:
        raise RuntimeError("injected predictor failure")


def raising(**_: Any) -> RaisingPredictor:
    return RaisingPredictor()
