"""benchmarks/engine_loop_cost.py on short played runs: a served engine's finishing outputs leave
after the reference's steps, in its batches, with its rows; a measured engine's wait for the
meter shows as finish lag; the plugin's stretches and a probe thread's lateness are recorded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from support.paths import ROOT

pytest.importorskip("vllm")
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine_loop_cost as bench  # noqa: E402

N, STEPS, STEP_MS, SEED = 16, 150, 0.5, 3


@pytest.fixture(scope="module")
def prior(tiny_model: Path) -> Any:
    from predictor_cost import tiny_shape

    from vllm_piep.config import PiepConfig
    from vllm_piep.predict.loader import load_predictor

    shape, arch = tiny_shape(tiny_model)
    return load_predictor(PiepConfig(), shape, "cpu", None, arch)


def _play(prior: Any, cell: bench.Cell) -> dict[str, Any]:
    return bench.play(prior, N, STEPS, STEP_MS, False, cell, seed=SEED)


@pytest.fixture(scope="module")
def reference(prior: Any) -> dict[str, Any]:
    return _play(prior, bench.Cell("plain", "prior", "predicted", "inside step"))


def test_served_outputs_leave_in_the_references_batches_with_its_rows(
        prior: Any, reference: dict[str, Any]) -> None:
    served = _play(prior, bench.Cell("plain", "prior", "predicted", "served"))
    assert bench.rows_match(reference["engine"], served["engine"])
    # The reference's rows on every output are not what a served engine sends.
    assert not bench.rows_match(reference["engine"], reference["engine"])
    lag = bench.finish_lag(reference["engine"], served["engine"])
    assert lag["finished"] > 0 and lag["max"] == 0 and lag["missing"] == 0
    stretches = served["stretches"]
    assert stretches["count"] > STEPS - bench.BLOCK and stretches["max_us"] > 0
    assert all(lane["count"] > 0 for lane in served["lateness"].values())


def test_a_measured_engines_held_outputs_show_as_finish_lag(
        prior: Any, reference: dict[str, Any]) -> None:
    measured = _play(prior, bench.Cell("plain", "prior", "measured", "served"))
    # The meter's counter moves every 20 ms: many 0.5 ms steps go by before it covers a
    # finishing output's steps.
    lag = bench.finish_lag(reference["engine"], measured["engine"])
    assert lag["missing"] == 0 and lag["max"] > 0 and lag["mean"] > 0
    assert measured["stretches"]["count"] > 0
