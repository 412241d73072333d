"""The analytic prior: energy-roofline coefficients of the device times the step's work."""

from __future__ import annotations

import numpy as np

from vllm_piep.meters.common import Source as MeterSource
from vllm_piep.model.components import COMPONENTS, STATIC
from vllm_piep.model.devices import DeviceProfile
from vllm_piep.model.flops import ModelShape, work_coefficients
from vllm_piep.predict.base import GraphPredictor, Source, fitted_source
from vllm_piep.predict.stepgraph import (
    FLOPS_FEATURE_ROWS,
    GRAPH_FEATURES,
    BusyPower,
    StepGraphSpec,
    work_key,
)


class PriorPredictor(GraphPredictor):
    """E = P_idle G T + busy (P_run + P_occ occ) + eps_flop FLOPs + eps_byte bytes
    + eps_link link bytes (`devices`' module docstring).

    Each request's dynamic energy is its own work times the coefficients (the split is the
    product itself), and the busy energy rides on it in proportion; idle energy is shared
    equally by the requests in the step.
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
        fit = ""
        if (static_scale, dynamic_scale) != (1.0, 1.0):
            self.source = fitted_source(fit_source)
            fit = ("meter-fit" if self.source == "calibrated"
                   else f"fit-to-{fit_meter or fit_source}")
            fit = f"+{fit}({static_scale:.3g},{dynamic_scale:.3g})"
        self.bundle_id = prior_id(shape, profile, fit)
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
            expert_read=(co.expert_miss, coefficients[1] * co.expert_bytes_full),
            busy=busy_power(shape, profile, self.devices, dynamic_scale)))
        assert leaves.shape[0] == len(GRAPH_FEATURES)


def prior_id(shape: ModelShape, profile: DeviceProfile, fit: str = "") -> str:
    """The prior's bundle id in responses: its profile, where its powers came from when not
    fitted on this GPU, a meter's correction (`fit`), what the shape approximated."""
    bundle_id = f"prior/{profile.name}"
    if profile.powers_transferred_from:
        bundle_id += f" (powers transferred from {profile.powers_transferred_from})"
    bundle_id += fit
    if shape.notes:
        bundle_id += f" (approximated: {'; '.join(shape.notes)})"
    return bundle_id


def busy_power(shape: ModelShape, profile: DeviceProfile, devices: int,
               dynamic_scale: float = 1.0) -> BusyPower | None:
    """The profile's load-following power for this model (`BusyPower`), None without one.
    The step's work at peak rates: FLOPs at the FLOP rate, memory and twice the link bytes at
    the memory bandwidth (each link byte is read and written), link bytes at the link's."""
    if profile.run_watts <= 0.0 and profile.occupancy_watts <= 0.0:
        return None
    co = work_coefficients(shape)
    seconds = (profile.seconds_per_flop * co.flops
               + profile.seconds_per_byte * (co.mem_bytes + 2.0 * co.link_bytes)
               + profile.seconds_per_link_byte * co.link_bytes).sum(axis=1)
    time_key = np.zeros(len(GRAPH_FEATURES))
    np.add.at(time_key, list(FLOPS_FEATURE_ROWS), seconds)
    return BusyPower(time_key=time_key,
                     expert_seconds=profile.seconds_per_byte * co.expert_bytes_full,
                     eta=profile.eta, devices=float(devices),
                     run_watts=profile.run_watts * dynamic_scale,
                     occupancy_watts=profile.occupancy_watts * dynamic_scale,
                     n_half=profile.n_half)
