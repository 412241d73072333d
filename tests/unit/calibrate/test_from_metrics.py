"""`calibrate from-metrics`: a prior correction from a measured server's /metrics, written as
JSON, served with `prior_correction` (static and dynamic parts scaled), refused with one line
where it does not fit."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from vllm_piep.calibrate.__main__ import main
from vllm_piep.calibrate.from_metrics import correction_from_metrics
from vllm_piep.config import PiepConfig
from vllm_piep.model.components import STATIC
from vllm_piep.model.flops import ModelShape
from vllm_piep.predict.correction import PriorCorrection
from vllm_piep.predict.loader import load_predictor

SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=4)


def metrics_text(bundle: str = "prior/cpu-avx2-2c", static: float = 1.4,
                 dynamic: float = 0.8, predicted: float = 100.0) -> str:
    return f"""# TYPE piep_measured_ratio gauge
piep_measured_ratio{{engine="0",group="static",bundle="{bundle}"}} {static}
piep_measured_ratio{{engine="0",group="dynamic",bundle="{bundle}"}} {dynamic}
# TYPE piep_engine_step_joules_total counter
piep_engine_step_joules_total 120.0
# TYPE piep_engine_predicted_joules_total counter
piep_engine_predicted_joules_total {predicted}
"""


def test_a_measured_servers_metrics_make_a_correction() -> None:
    fit = correction_from_metrics(metrics_text(), "saved.txt")
    assert (fit.static_ratio, fit.dynamic_ratio, fit.bundle) == (1.4, 0.8, "prior/cpu-avx2-2c")
    assert (fit.measured_joules, fit.predicted_joules, fit.engines) == (120.0, 100.0, 1)


@pytest.mark.parametrize("text,message", [
    ("# TYPE x counter\nx 1\n", "did not run in measured mode"),
    (metrics_text(predicted=0.0), "nothing was measured"),
    (metrics_text(bundle="cpu-tiny-llama"), "only the prior"),
    (metrics_text(static=0.0), "did not run in measured mode"),
])
def test_metrics_without_a_usable_fit_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        correction_from_metrics(text, "saved.txt")


def test_the_cli_writes_json_and_exits_2_on_bad_input(tmp_path: Path, capsys) -> None:
    saved = tmp_path / "metrics.txt"
    saved.write_text(metrics_text())
    out = tmp_path / "fit.json"
    assert main(["from-metrics", str(saved), "--out", str(out)]) == 0
    assert PriorCorrection.read(out).static_ratio == 1.4
    assert json.loads(out.read_text())["schema"] == "vllm_piep/prior-correction/1"
    (tmp_path / "empty.txt").write_text("")
    assert main(["from-metrics", str(tmp_path / "empty.txt")]) == 2
    assert main(["from-metrics", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    ("not json", "not JSON"),
    ('{"schema": "vllm_piep/prior-correction/1", "static_ratio": -1}', "static_ratio"),
])
def test_a_bad_correction_file_is_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "fit.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        PriorCorrection.read(path)
    assert str(path) in str(info.value)


def step_parts(predictor) -> tuple[float, float]:
    """(static, dynamic) joules of one prefill step of 64 tokens lasting 10 ms."""
    sched = np.array([[0.0], [64.0], [0.0], [1.0]])
    _, joules = predictor.run_step(sched, np.array([[64.0]]), 0.01)
    static = float(joules[STATIC])
    return static, float(joules.sum()) - static


def test_the_served_prior_takes_the_correction_where_it_fits(tmp_path: Path, caplog) -> None:
    plain = load_predictor(PiepConfig(device_profile="cpu"), SHAPE, "cpu", None)
    path = tmp_path / "fit.json"
    correction_from_metrics(metrics_text(bundle=plain.bundle_id), "x").write(path)
    config = PiepConfig(device_profile="cpu", prior_correction=str(path))
    corrected = load_predictor(config, SHAPE, "cpu", None)
    assert corrected.source == "calibrated" and "meter-fit" in corrected.bundle_id
    (s0, d0), (s1, d1) = step_parts(plain), step_parts(corrected)
    assert s1 == pytest.approx(1.4 * s0) and d1 == pytest.approx(0.8 * d0)
    other = tmp_path / "other.json"
    correction_from_metrics(metrics_text(bundle="prior/nvidia-h100-sxm"), "x").write(other)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        served = load_predictor(PiepConfig(device_profile="cpu",
                                           prior_correction=str(other)), SHAPE, "cpu", None)
    assert served.bundle_id == plain.bundle_id and served.source == "prior"
    assert "measured on prior/nvidia-h100-sxm" in caplog.text
