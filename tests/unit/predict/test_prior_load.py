"""The prior's power per GPU follows each GPU's share of the work: a model spread over more
GPUs, or serving few requests, is charged toward idle power, on every fitted or transferred
GPU profile."""

from __future__ import annotations

import numpy as np
import pytest
from support.paths import PUBLISHED_DATA

from vllm_piep.calibrate.published import hf_config
from vllm_piep.datasets.model import read_csv_table
from vllm_piep.model.devices import GPU_SPECS, DeviceProfile
from vllm_piep.model.flops import ModelShape, StepBatch, step_work
from vllm_piep.predict.base import StepInput
from vllm_piep.predict.prior import PriorPredictor

# Llama-3.1-8B's shape.
LLAMA_8B = {"hidden": 4096, "intermediate": 14336, "layers": 32, "heads": 32, "kv_heads": 8,
            "head_dim": 128, "vocab": 128256, "dtype_bytes": 2}
# A decode step runs its kernels at a fraction of peak bandwidth, and part of its time
# (launches, sampling, synchronisation) does not split over GPUs.
BANDWIDTH_SHARE = 0.7
UNSPLIT_SECONDS = 0.002


def _at_peak(p: PriorPredictor, batch: StepBatch) -> float:
    """The step's GPU-seconds at the profile's peak rates (the prior's K)."""
    work, prof = step_work(p.shape, batch), p.profile
    return float(prof.seconds_per_flop * work.flops.sum()
                 + prof.seconds_per_byte * (work.mem_bytes.sum() + 2 * work.link_bytes.sum())
                 + prof.seconds_per_link_byte * work.link_bytes.sum())


def _watts_per_gpu(profile: str, tp: int, requests: int) -> float:
    """Power per GPU the prior charges for a decode step of `requests` at context 1,000,
    the step lasting its work per GPU at `BANDWIDTH_SHARE` of peak plus `UNSPLIT_SECONDS`."""
    spec = GPU_SPECS[profile]
    shape = ModelShape(**LLAMA_8B, tp=tp)  # type: ignore[arg-type]
    p = PriorPredictor(shape, DeviceProfile.from_spec(spec, shape.dtype_bytes))
    batch = StepBatch.from_lists([0] * requests, [1] * requests, [1000] * requests,
                                 [1] * requests)
    seconds = _at_peak(p, batch) / tp / BANDWIDTH_SHARE + UNSPLIT_SECONDS
    joules = p.predict_step(StepInput(batch, seconds)).joules.sum()
    return float(joules / (tp * seconds))


@pytest.mark.parametrize("profile", ["h100-sxm5-80gb", "b200", "mi300x", "l4"])
@pytest.mark.parametrize("requests", [1, 4, 8])
def test_power_per_gpu_falls_as_the_same_model_is_spread_over_more_gpus(profile: str,
                                                                       requests: int) -> None:
    watts = [_watts_per_gpu(profile, tp, requests) for tp in (1, 2, 4, 8)]
    idle = GPU_SPECS[profile].static_watts
    assert all(w > idle for w in watts), watts
    assert np.all(np.diff(watts) < 0), watts


def test_a_tp8_gpt_oss_120b_server_at_4_requests_is_charged_by_its_busy_share() -> None:
    """Eight H100s serving gpt-oss-120b (MXFP4 experts, 5.1 B active parameters) to four
    requests, a 6 ms decode step: each GPU's work at peak is a few percent of the step, so
    each GPU is charged idle plus its busy share min(1, share / eta) of P_run and of the
    occupancy power, plus the energy of its FLOPs and bytes (a few watts). With eta fitted to
    ML.ENERGY's GPU-count pairs the share here sits near eta, so the charge lies between
    idle and idle + P_run + P_occ x occupancy, and falls toward idle as the share falls below
    eta."""
    rows = read_csv_table(PUBLISHED_DATA / "model_structures.csv").to_dict("records")
    row = next(r for r in rows if r["model_id"] == "openai/gpt-oss-120b")
    shape = ModelShape.from_hf_config(hf_config(row, "mxfp4"), dtype_bytes=2, tp=8)
    profile = DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], shape.dtype_bytes)
    p = PriorPredictor(shape, profile)
    batch = StepBatch.from_lists([0] * 4, [1] * 4, [2000] * 4, [1] * 4)
    seconds = 0.006
    share = _at_peak(p, batch) / (8 * seconds)
    busy = min(1.0, share / profile.eta)
    occupancy = 4 / (4 + 8 * profile.n_half)
    watts = p.predict_step(StepInput(batch, seconds)).joules.sum() / (8 * seconds)
    lower = profile.idle_watts + busy * profile.run_watts
    upper = lower + busy * profile.occupancy_watts * occupancy
    work = watts - upper  # the FLOPs' and bytes' own energy, per GPU
    assert lower < watts and 0 < work < 0.05 * profile.run_watts
    # Half the share (a step twice as long) is charged no more per GPU.
    slower = p.predict_step(StepInput(batch, 2 * seconds)).joules.sum() / (16 * seconds)
    assert slower <= watts
