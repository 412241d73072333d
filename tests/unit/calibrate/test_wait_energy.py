"""The campaign's synchronization waits (`campaign_data._with_energies`): each wait is priced at
the power its collective replays measured; when they measured none above idle (a machine
loaded by another process during the campaign), its waits carry no energy and the dataset says
so in a warning and a count, instead of leaving them unpriced without a word."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from vllm_piep.calibrate.campaign_data import _summary, _with_energies

TREE = "spans/i/dp0/step3"


def attempt() -> SimpleNamespace:
    """What `_with_energies` reads of an attempt: its steps (none sampled), tree ids, root
    energies."""
    steps = pd.DataFrame({"step": [3], "replay_ns": [0], "cell": ["b1-o4"]})
    return SimpleNamespace(att=SimpleNamespace(config="tp2-pp1", attempt=1), steps=steps,
                           tree_id=lambda step: f"spans/i/dp0/step{step}",
                           step_energy=lambda: pd.Series({3: 2.0}))


def step_nodes() -> pd.DataFrame:
    """A root with a module leaf and one all-reduce's transfer and wait."""
    return pd.DataFrame({
        "tree_id": TREE,
        "node_id": ["root", "mlp", "all_reduce", "all_reduce@wait"],
        "parent_id": ["", "root", "root", "root"],
        "type": ["root", "module", "transfer", "wait"],
        "prefill_tokens": 0.0, "decode_tokens": 1.0,
        "time_s": [0.01, 0.004, 0.001, 0.002], "wait_s": [np.nan, np.nan, np.nan, 0.0015]})


def collective_replays(joules_per_call: float, seconds: float) -> pd.DataFrame:
    return pd.DataFrame({"tree_id": [TREE], "node_id": [np.nan], "target": ["collective"],
                         "joules_per_call": [joules_per_call], "calls": [10.0],
                         "seconds": [seconds]})


def test_waits_are_priced_at_the_collective_replays_power() -> None:
    nodes, warning = _with_energies(step_nodes(), attempt(), collective_replays(0.5, 0.1))
    wait = nodes.set_index("node_id").loc["all_reduce@wait"]
    assert warning is None
    assert wait.energy_j == pytest.approx(0.0015 * 0.5 * 10 / 0.1)  # wait_s x 50 W
    assert wait.energy_source == "sync-sampling"


@pytest.mark.parametrize(("joules_per_call", "seconds", "said"), [
    (-0.01, 0.1, "measured -1 W above idle over 0.10 s (another process"),
    (0.0, 0.1, "measured 0 W above idle"),
    (np.nan, 0.0, "were not measured"),
])
def test_waits_without_replay_power_are_unpriced_and_said(
        joules_per_call: float, seconds: float, said: str) -> None:
    samples = collective_replays(joules_per_call, seconds).dropna(subset=["joules_per_call"])
    nodes, warning = _with_energies(step_nodes(), attempt(), samples)
    assert np.isnan(nodes.set_index("node_id").loc["all_reduce@wait"].energy_j)
    assert warning is not None and "\n" not in warning
    assert warning.startswith("tp2-pp1 attempt 1: the collective replays ")
    assert said in warning and warning.endswith("its 1 synchronization waits carry no energy")
    ds = SimpleNamespace(nodes=nodes.assign(level="module"), issues=[],
                         trees=pd.DataFrame({"tree_id": [TREE], "group": ["tp2-pp1/b1-o4"]}))
    assert _summary(ds)["waits_without_energy"] == 1  # type: ignore[arg-type]


def test_an_attempt_without_waits_has_nothing_to_say() -> None:
    nodes = step_nodes().iloc[:3]
    _, warning = _with_energies(nodes, attempt(), collective_replays(0.0, 0.1))
    assert warning is None
