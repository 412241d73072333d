"""The campaign's root energies (`campaign_data.pooled_step_energy`): each step's power is its
shape's when that shape's unsampled steps last long enough for the meter, else its kind's
(prefill or decode) over batch sizes, else every step's."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from vllm_piep.calibrate.campaign_data import pooled_step_energy

IDLE_W = 10.0
FLOOR_S = 0.1


def _steps(rows: list[tuple[int, int, float, float, float]]) -> tuple[pd.DataFrame, np.ndarray]:
    """(num_reqs, prefill tokens, own seconds, replay seconds, dynamic watts) per step, back
    to back; the meter's joules over each step's whole time (replays included) at idle plus
    its dynamic power over its own time."""
    t, frame, joules = 0, [], []
    for step, (num_reqs, prefill, own_s, replay_s, watts) in enumerate(rows):
        length = int((own_s + replay_s) * 1e9)
        frame.append({"step": step, "start_ns": t, "end_ns": t + length,
                      "replay_ns": int(replay_s * 1e9), "num_reqs": num_reqs,
                      "prefill": prefill, "decode": 0 if prefill else num_reqs})
        joules.append(IDLE_W * (own_s + replay_s) + watts * own_s)
        t += length
    return pd.DataFrame(frame), np.array(joules)


def test_a_resolved_shape_keeps_its_power_and_short_ones_pool() -> None:
    rows = ([(4, 0, 0.01, 0.0, 50.0)] * 100  # decode, batch 4: 1 s at 50 W, resolved alone
            + [(1, 0, 0.001, 0.0, 30.0)] * 5  # decode, batch 1: 5 ms, short alone
            + [(1, 24, 0.004, 0.5, 80.0), (1, 24, 0.002, 0.0, 80.0)])  # prefill, one sampled
    steps, joules = _steps(rows)
    energy = pooled_step_energy(steps, joules, IDLE_W, FLOOR_S).to_numpy()
    assert energy[:100] == pytest.approx(50.0 * 0.01, rel=1e-6)
    decode_w = (50.0 * 1.0 + 30.0 * 0.005) / 1.005  # batch 1 takes the decode steps' power
    assert energy[100:105] == pytest.approx(decode_w * 0.001, rel=1e-6)
    # The prefill steps last 2 ms unsampled: they take every unsampled step's power, and the
    # sampled one its shape's median unsampled time, not its own.
    all_w = (50.0 * 1.0 + 30.0 * 0.005 + 80.0 * 0.002) / 1.007
    assert energy[105:] == pytest.approx([all_w * 0.002, all_w * 0.002], rel=1e-6)


def test_steps_too_short_for_the_meter_even_pooled_are_unresolved() -> None:
    steps, joules = _steps([(1, 0, 0.001, 0.0, 30.0)] * 20 + [(1, 24, 0.004, 0.3, 80.0)])
    energy = pooled_step_energy(steps, joules, IDLE_W, FLOOR_S)
    assert energy.isna().all() and list(energy.index) == list(range(21))


def test_a_sampled_step_whose_shape_has_no_unsampled_step_is_unresolved() -> None:
    steps, joules = _steps([(4, 0, 0.01, 0.0, 50.0)] * 20 + [(2, 0, 0.01, 0.3, 50.0)])
    energy = pooled_step_energy(steps, joules, IDLE_W, FLOOR_S).to_numpy()
    assert energy[:20] == pytest.approx(50.0 * 0.01, rel=1e-6)
    assert np.isnan(energy[20])
