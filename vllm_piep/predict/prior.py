"""The analytic prior: energy-roofline coefficients of the device times the step's work."""

from __future__ import annotations

from vllm_piep.components import STATIC
from vllm_piep.flops import ModelShape, step_features, work_coefficients
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
        co = work_coefficients(shape)
        # Joules per unit of each step feature: a step is then one matrix product.
        self._joules_per_feature = (profile.joules_per_flop * co.flops
                                    + profile.joules_per_byte * co.mem_bytes
                                    + profile.joules_per_link_byte * co.link_bytes)

    def predict_step(self, step: StepInput) -> StepEnergy:
        # Each request's dynamic joules per component: the split by work is the product itself.
        per_request = step_features(step.batch) @ self._joules_per_feature  # static column 0
        dynamic = per_request.sum(axis=1)
        static = self.profile.static_watts * self.devices * max(step.step_seconds, 0.0)
        total_dynamic = float(dynamic.sum())
        # Static energy follows the requests' share of the device's busy work.
        if total_dynamic > 0:
            per_request[:, STATIC] = dynamic * (static / total_dynamic)
        else:
            per_request[:, STATIC] = static / len(per_request)
        return StepEnergy(joules=per_request.sum(axis=0), work=per_request, work_is_split=True)
