"""The analytic prior: energy-roofline coefficients of the device times the step's work."""

from __future__ import annotations

import numpy as np

from vllm_piep.meters.common import Source as MeterSource
from vllm_piep.model.components import COMPONENTS, STATIC
from vllm_piep.model.devices import DeviceProfile
from vllm_piep.model.flops import ModelShape, work_coefficients
from vllm_piep.predict.base import GraphPredictor, Source, fitted_source
from vllm_piep.predict.stepgraph import GRAPH_FEATURES, StepGraphSpec, work_key


class PriorPredictor(GraphPredictor):
    """E = eps_flop * FLOPs + eps_byte * bytes + eps_link * link bytes + P_static * T.

    Each request's dynamic energy is its own work times the coefficients (the split is the
    product itself); static energy is shared equally by the requests in the step.
    Synchronization wait is not modelled by the prior (it needs measured per-rank arrival
    times, which only detail mode records), so `sync_wait` is always 0 here.
    """

    source: Source = "prior"

    def __init__(self, shape: ModelShape, profile: DeviceProfile,
                 static_scale: float = 1.0, dynamic_scale: float = 1.0,
                 fit_meter: str | None = None, fit_source: MeterSource = "measured") -> None:
        """`static_scale`, `dynamic_scale`: a meter's correction of the two parts
        (`calibrate from-metrics`), fitted to `fit_meter` (None: not recorded), whose energy
        is `fit_source`. Fitted to a meter that measures, the predictor says `calibrated` and
        `+meter-fit(a,b)`; to an estimate or a simulator, that kind (`estimated`,
        `simulated`) and `+fit-to-<meter>(a,b)`."""
        self.shape = shape
        self.profile = profile
        self.bundle_id = f"prior/{profile.name}"
        if profile.powers_transferred_from:  # not fitted on this GPU: the response says so
            self.bundle_id += f" (powers transferred from {profile.powers_transferred_from})"
        if (static_scale, dynamic_scale) != (1.0, 1.0):
            self.source = fitted_source(fit_source)
            fit = ("meter-fit" if self.source == "calibrated"
                   else f"fit-to-{fit_meter or fit_source}")
            self.bundle_id += f"+{fit}({static_scale:.3g},{dynamic_scale:.3g})"
        if shape.notes:  # what the shape approximated: the response's bundle id says so
            self.bundle_id += f" (approximated: {'; '.join(shape.notes)})"
        ranks = shape.tp * shape.pp
        self.devices = ranks if profile.one_device_per_rank else 1
        self.idle_watts = profile.idle_watts * self.devices
        coefficients = (profile.joules_per_flop * dynamic_scale,
                        profile.joules_per_byte * dynamic_scale,
                        profile.joules_per_link_byte * dynamic_scale)
        key = work_key(shape, *coefficients)
        key[:, COMPONENTS.index("sync_wait")] = 0.0  # no wait model: no wait energy
        # A component's energy is the sum of its requests' work: "leaves" are the components,
        # linear in the per-feature sums, with no static part (that is P_static * T). An MoE
        # model's routed-expert reads are the graph's own term (`expert_read`).
        leaves = work_key(shape, *coefficients, expert_split=False)
        leaves[:, COMPONENTS.index("sync_wait")] = 0.0
        leaves[:, STATIC] = 0.0
        co = work_coefficients(shape)
        super().__init__(StepGraphSpec(
            work_key=key, leaf_weights=leaves, leaf_bias=np.zeros(len(COMPONENTS)),
            leaf_component=np.arange(len(COMPONENTS)),
            static_watts=profile.static_watts * self.devices * static_scale,
            expert_read=(co.expert_miss, coefficients[1] * co.expert_bytes_full)))
        assert leaves.shape[0] == len(GRAPH_FEATURES)
