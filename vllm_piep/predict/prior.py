"""The analytic prior: energy-roofline coefficients of the device times the step's work."""

from __future__ import annotations

import numpy as np

from vllm_piep.components import STATIC
from vllm_piep.flops import ModelShape, step_work
from vllm_piep.predict.base import Source, StepEnergy, StepInput
from vllm_piep.predict.profiles import DeviceProfile


class PriorPredictor:
    """E = eps_flop * FLOPs + eps_byte * bytes + eps_link * link bytes + P_static * T.

    Synchronization wait is not modelled by the prior (it needs measured per-rank arrival
    times, which only detail mode records), so `sync_wait` is always 0 here.
    """

    source: Source = "prior"

    def __init__(self, shape: ModelShape, profile: DeviceProfile) -> None:
        self.shape = shape
        self.profile = profile
        self.bundle_id = f"prior/{profile.name}"
        ranks = shape.tp * shape.pp
        self.devices = ranks if profile.one_device_per_rank else 1

    def predict_step(self, step: StepInput) -> StepEnergy:
        work = step_work(self.shape, step.batch)
        p = self.profile
        dynamic = (
            p.joules_per_flop * work.flops
            + p.joules_per_byte * work.mem_bytes
            + p.joules_per_link_byte * work.link_bytes
        )
        joules = dynamic.sum(axis=0)
        joules[STATIC] = p.static_watts * self.devices * max(step.step_seconds, 0.0)
        # Static energy follows the requests' share of the device's busy work.
        dynamic[:, STATIC] = dynamic.sum(axis=1)
        return StepEnergy(joules=joules, work=dynamic)
