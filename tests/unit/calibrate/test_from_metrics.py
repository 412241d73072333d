"""`calibrate from-metrics`: a prior correction from a measured server's /metrics, written as
JSON with the meter it was fitted to, served with `prior_correction` (static and dynamic parts
scaled; `estimated` or `simulated` where that meter does not measure), refused with one line
where it does not fit."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from vllm_piep.calibrate.__main__ import main
from vllm_piep.calibrate.from_metrics import correction_from_metrics, estimate_warning
from vllm_piep.config import PiepConfig
from vllm_piep.model.components import STATIC
from vllm_piep.model.flops import ModelShape
from vllm_piep.predict.correction import PriorCorrection
from vllm_piep.predict.loader import load_predictor

SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=4)


def metrics_text(bundle: str = "prior/cpu-avx2-2c", static: float = 1.4,
                 dynamic: float = 0.8, predicted: float = 100.0, meter: str = "rapl",
                 sources: tuple[str, ...] = ("measured",)) -> str:
    """A measured server's /metrics: its engine's meter, the energy under the meter's source
    (and under `fitted`, which is no meter's kind), the ratios and totals."""
    energy = "".join(f'piep_energy_joules_total{{source="{s}"}} 50.0\n'
                     for s in (*sources, "fitted"))
    return f"""# TYPE piep_engine_measured gauge
piep_engine_measured{{engine="0",meter="{meter}",reason=""}} 1.0
# TYPE piep_energy_joules counter
{energy}# TYPE piep_measured_ratio gauge
piep_measured_ratio{{engine="0",group="static",bundle="{bundle}"}} {static}
piep_measured_ratio{{engine="0",group="dynamic",bundle="{bundle}"}} {dynamic}
# TYPE piep_engine_step_joules_total counter
piep_engine_step_joules_total 120.0
# TYPE piep_engine_predicted_joules_total counter
piep_engine_predicted_joules_total {predicted}
"""


ESTIMATED = metrics_text(meter="cpu-estimate", sources=("estimated",))


def test_a_measured_servers_metrics_make_a_correction() -> None:
    fit = correction_from_metrics(metrics_text(), "saved.txt")
    assert (fit.static_ratio, fit.dynamic_ratio, fit.bundle) == (1.4, 0.8, "prior/cpu-avx2-2c")
    assert (fit.measured_joules, fit.predicted_joules, fit.engines) == (120.0, 100.0, 1)
    assert (fit.meter, fit.meter_source) == ("rapl", "measured")


@pytest.mark.parametrize("meter,sources,kind", [
    ("cpu-estimate", ("estimated",), "estimated"),
    ("simulated", ("simulated",), "simulated"),
    ("nvml+cpu-estimate", ("measured", "estimated"), "estimated"),  # the least trustworthy
])
def test_the_correction_records_the_meter_and_what_it_is(meter: str, sources: tuple[str, ...],
                                                        kind: str) -> None:
    fit = correction_from_metrics(metrics_text(meter=meter, sources=sources), "saved.txt")
    assert (fit.meter, fit.meter_source) == (meter, kind)


@pytest.mark.parametrize("text,message", [
    ("# TYPE x counter\nx 1\n", "did not run in measured mode"),
    (metrics_text(predicted=0.0), "nothing was measured"),
    (metrics_text(bundle="cpu-tiny-llama"), "only the prior"),
    (metrics_text(static=0.0), "did not run in measured mode"),
    (metrics_text(meter=""), "names no meter"),
    (metrics_text(sources=()), "whether the meter measures"),
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
    raw = json.loads(out.read_text())
    assert raw["schema"] == "vllm_piep/prior-correction/2"
    assert (raw["meter"], raw["meter_source"]) == ("rapl", "measured")
    assert "warning" not in capsys.readouterr().err  # a meter that measures: nothing to say
    (tmp_path / "empty.txt").write_text("")
    assert main(["from-metrics", str(tmp_path / "empty.txt")]) == 2
    assert main(["from-metrics", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err


def test_the_cli_warns_once_of_a_fit_to_an_estimate(tmp_path: Path, capsys) -> None:
    """It writes the file (an estimate corrected by an estimate serves for tests) and says, in
    one line, which meter the fit is to and what responses served with it will say."""
    saved = tmp_path / "metrics.txt"
    saved.write_text(ESTIMATED)
    out = tmp_path / "fit.json"
    assert main(["from-metrics", str(saved), "--out", str(out)]) == 0
    assert PriorCorrection.read(out).meter_source == "estimated"
    captured = capsys.readouterr()
    lines = [x for x in (captured.out + captured.err).splitlines() if "warning" in x]
    assert len(lines) == 1, lines
    assert "cpu-estimate" in lines[0] and '"source": "estimated"' in lines[0]


def test_the_warning_names_the_meter_only_where_it_does_not_measure() -> None:
    assert estimate_warning(correction_from_metrics(metrics_text(), "x")) is None
    line = estimate_warning(correction_from_metrics(
        metrics_text(meter="simulated", sources=("simulated",)), "x"))
    assert line is not None and "simulated" in line and '"source": "simulated"' in line


def written(tmp_path: Path, **fields: object) -> Path:
    """A correction file with these fields changed, as JSON (no validation on the way)."""
    fit = correction_from_metrics(metrics_text(), "x")
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({**fit.model_dump(by_alias=True), **fields}))
    return path


def test_the_correction_round_trips_with_its_meter(tmp_path: Path) -> None:
    fit = correction_from_metrics(ESTIMATED, "x")
    path = tmp_path / "fit.json"
    fit.write(path)
    again = PriorCorrection.read(path)
    assert again == fit
    assert (again.meter, again.meter_source, again.served_source) == (
        "cpu-estimate", "estimated", "estimated")


def first_schema_file(path: Path, fit: PriorCorrection) -> Path:
    """`fit` as a file of schema /1 writes it: no meter."""
    raw = {k: v for k, v in fit.model_dump(by_alias=True).items()
           if k not in ("meter", "meter_source")}
    path.write_text(json.dumps({**raw, "schema": "vllm_piep/prior-correction/1"}))
    return path


def test_a_file_of_the_first_schema_is_refused_naming_how_to_remake_it(tmp_path: Path) -> None:
    """It records no meter: whether it may say `calibrated` cannot be told."""
    path = first_schema_file(tmp_path / "old.json", correction_from_metrics(ESTIMATED, "x"))
    with pytest.raises(ValueError, match="does not record the meter") as info:
        PriorCorrection.read(path)
    message = str(info.value)
    assert str(path) in message and "calibrate from-metrics" in message
    assert "\n" not in message


@pytest.mark.parametrize("content,message", [
    ("not json", "not JSON"),
    ('{"schema": "vllm_piep/prior-correction/2", "static_ratio": -1}', "static_ratio"),
])
def test_a_bad_correction_file_is_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "fit.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        PriorCorrection.read(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("fields,message", [
    ({"meter": None}, "meter"),
    ({"meter_source": "guessed"}, "meter_source"),
    ({"schema": "vllm_piep/prior-correction/3"}, "schema"),
])
def test_a_file_whose_meter_does_not_fit_its_schema_is_named(tmp_path: Path, fields: dict,
                                                            message: str) -> None:
    path = written(tmp_path, **fields)
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
    assert corrected.source == "calibrated" and "+meter-fit(" in corrected.bundle_id
    (s0, d0), (s1, d1) = step_parts(plain), step_parts(corrected)
    assert s1 == pytest.approx(1.4 * s0) and d1 == pytest.approx(0.8 * d0)
    other = tmp_path / "other.json"
    correction_from_metrics(metrics_text(bundle="prior/nvidia-h100-sxm"), "x").write(other)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        served = load_predictor(PiepConfig(device_profile="cpu",
                                           prior_correction=str(other)), SHAPE, "cpu", None)
    assert served.bundle_id == plain.bundle_id and served.source == "prior"
    assert "measured on prior/nvidia-h100-sxm" in caplog.text


def test_a_prior_fitted_to_an_estimate_serves_as_an_estimate(tmp_path: Path) -> None:
    plain = load_predictor(PiepConfig(device_profile="cpu"), SHAPE, "cpu", None)
    path = tmp_path / "fit.json"
    correction_from_metrics(metrics_text(bundle=plain.bundle_id, meter="cpu-estimate",
                                         sources=("estimated",)), "x").write(path)
    served = load_predictor(PiepConfig(device_profile="cpu", prior_correction=str(path)),
                            SHAPE, "cpu", None)
    assert served.source == "estimated"
    assert served.bundle_id == f"{plain.bundle_id}+fit-to-cpu-estimate(1.4,0.8)"


def test_a_file_without_its_meter_stops_the_start_and_never_serves_as_calibrated(
        tmp_path: Path, caplog) -> None:
    plain = load_predictor(PiepConfig(device_profile="cpu"), SHAPE, "cpu", None)
    path = first_schema_file(tmp_path / "old.json", correction_from_metrics(
        metrics_text(bundle=plain.bundle_id), "x"))
    config = PiepConfig(device_profile="cpu", prior_correction=str(path))
    with pytest.raises(ValueError, match="does not record the meter"):
        load_predictor(config, SHAPE, "cpu", None, strict=True)  # the check before serving
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        served = load_predictor(config, SHAPE, "cpu", None)  # an engine: the plain prior
    assert served.source == "prior" and served.bundle_id == plain.bundle_id
    assert "does not record the meter" in caplog.text
