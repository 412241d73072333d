"""The campaign's plans, flags, prompts and cells without a server: the plans and states it
refuses before starting one, the command line, deterministic prompts, a cell's requests against
a stand-in server (the campaign on a real vLLM: tests/e2e/test_campaign_driver.py)."""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from rich.console import Console

from vllm_piep.calibrate.campaign import (
    STATE_FILE,
    CampaignError,
    CampaignPlan,
    CampaignState,
    add_run_arguments,
    plan_from_args,
    prompt_ids,
    run_campaign,
    run_command,
)
from vllm_piep.cli_errors import UsageError

CELLS = ["b1-o4", "b1-o16", "b2-o4", "b2-o16"]


def grid_plan(model: Path) -> CampaignPlan:
    """The quick preset (with its repeated sampling) on one config and four cells. Each cell
    takes a second or two (sampled steps replay every module for 2 x 0.06 s): time enough to
    interrupt or crash the campaign between two cells."""
    quick = CampaignPlan.quick(str(model)).model_dump()
    return CampaignPlan(**{**quick, "tp": [1], "batch": [1, 2], "out_len": [4, 16],
                           "max_model_len": None,
                           "sampling": {"windows": 2, "min_window_s": 0.03, "every": 8}})


def quiet() -> Console:
    return Console(file=io.StringIO(), width=120, force_terminal=False)


def test_plans_are_checked_before_anything_starts(tmp_path: Path) -> None:
    model = str(tmp_path)
    cores = os.cpu_count() or 1
    with pytest.raises(ValidationError, match=f"tp{cores}-pp2 needs {2 * cores} ranks"):
        CampaignPlan(model=model, tp=[1, cores], pp=[2], batch=[1], out_len=[1])
    with pytest.raises(ValidationError, match=f"tp{cores + 1}-pp1 needs {cores + 1} ranks"):
        CampaignPlan(model=model, tp=[cores + 1], batch=[1], out_len=[1])
    bad: list[tuple[dict[str, Any], str]] = [
        ({"batch": []}, "`batch` is empty"),
        ({"out_len": [8, 0]}, "`out_len` must hold positive integers"),
        ({"tp": [1, -1]}, "`tp` must hold positive integers"),
        ({"pp": [1, 1]}, "`pp` lists a value twice"),
        ({"prompt_tokens": 0}, "`prompt_tokens` must be positive"),
        ({"idle_s": 0}, "`idle_s` must be positive"),
        ({"meter_interval_s": -1}, "`meter_interval_s` must be positive"),
        ({"meter": "wattmeter"}, "unknown meter 'wattmeter'"),
        ({"sampling": {"windows": 1}}, "windows"),
        ({"max_model_len": 100}, "shorter than prompt_tokens"),
        ({"bogus": 1}, "Extra inputs are not permitted"),
    ]
    for fields, message in bad:
        with pytest.raises(ValidationError, match=message):
            CampaignPlan(**{"model": model, "tp": [1], **fields})
    plan = CampaignPlan(model=model, tp=[1], batch=[2], out_len=[5, 9], prompt_tokens=7)
    assert plan.max_model_len == 7 + 9 + 16
    assert (plan.configs(), plan.cells()) == (["tp1-pp1"], ["b2-o5", "b2-o9"])


def test_quick_preset() -> None:
    plan = CampaignPlan.quick("/m")
    assert (plan.tp, plan.pp, plan.batch, plan.out_len) == ([1, 2], [1], [1, 4], [16, 48])
    assert (plan.prompt_tokens, plan.meter, plan.meter_interval_s, plan.dtype) == \
        (24, "cpu-estimate", 0.02, "float32")
    # windows of several meter readings; an idle window of many
    assert plan.sampling["min_window_s"] >= 5 * plan.meter_interval_s
    assert plan.idle_s >= 50 * plan.meter_interval_s
    assert plan.max_model_len == 24 + 48 + 16
    assert plan.configs() == ["tp1-pp1", "tp2-pp1"]


def test_resume_refuses_a_different_plan_and_a_fresh_run_an_existing_campaign(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    plan = CampaignPlan(model=str(tmp_path), tp=[1], batch=[1, 2], out_len=[4])
    CampaignState.new(plan).save(out / STATE_FILE)
    before = (out / STATE_FILE).read_bytes()
    with pytest.raises(CampaignError, match="use --resume to go on with it, or another --out"):
        run_campaign(plan, out, console=quiet())
    other = CampaignPlan(model=str(tmp_path), tp=[1], batch=[1, 4], out_len=[4], seed=3)
    with pytest.raises(CampaignError) as caught:
        run_campaign(other, out, resume=True, console=quiet())
    message = str(caught.value)
    assert "the plan differs" in message
    assert "batch: [1, 2] in the campaign, [1, 4] now" in message
    assert "seed: 0 in the campaign, 3 now" in message and "out_len" not in message
    assert (out / STATE_FILE).read_bytes() == before and not (out / "runs").exists()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return parser.parse_args(list(argv))


def test_command_line_flags_build_the_plan(tmp_path: Path) -> None:
    plan = plan_from_args(parse("--model", "/m", "--out", "o", "--quick", "--batch", "2,3",
                                "--out-len", "40"))
    assert (plan.tp, plan.batch, plan.out_len, plan.prompt_tokens, plan.meter) == \
        ([1, 2], [2, 3], [40], 24, "cpu-estimate")
    assert plan.max_model_len == 24 + 40 + 16  # recomputed for the longer output
    plan = plan_from_args(parse("--model", "/m", "--out", "o", "--tp", "1", "--pp", "1",
                                "--batch", "8", "--prompt-tokens", "64", "--meter", "auto",
                                "--meter-interval", "0.1"))
    assert (plan.tp, plan.batch, plan.out_len, plan.prompt_tokens, plan.meter_interval_s) == \
        ([1], [8], [512, 1024], 64, 0.1)
    defaults = CampaignPlan.model_fields["sampling"].default_factory()  # type: ignore[misc]
    assert plan.sampling == defaults != CampaignPlan.quick("/m").sampling  # not the preset
    with pytest.raises(SystemExit):
        parse("--model", "/m", "--out", "o", "--tp", "1,two")
    with pytest.raises(SystemExit):
        parse("--model", "/m")  # --out is required
    with pytest.raises(SystemExit):
        parse("--model", "/m", "--out", "o", "--batch", "0")  # the flag's type refuses it
    console = quiet()
    sigterm = signal.getsignal(signal.SIGTERM)  # run_command turns SIGTERM into SystemExit
    try:
        with pytest.raises(UsageError, match="invalid plan: .*unknown meter 'bogus'"):
            run_command(parse("--model", "/m", "--out", str(tmp_path / "o"), "--quick",
                              "--meter", "bogus"), console)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert not (tmp_path / "o").exists()


def test_prompts_are_deterministic_distinct_and_inside_the_vocabulary() -> None:
    a = prompt_ids(0, "b2-o4", 0, 24, 2048)
    assert a == prompt_ids(0, "b2-o4", 0, 24, 2048) and len(a) == 24
    assert a != prompt_ids(0, "b2-o4", 1, 24, 2048) != prompt_ids(1, "b2-o4", 0, 24, 2048)
    assert all(4 <= t < 2048 for t in a)


class StubServer:
    """Answers /v1/completions the way vLLM does, or with fewer tokens, or not at all."""

    def __init__(self, short_by: int = 0, error: Exception | None = None,
                 exit_code: int | None = None) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.short_by, self.error, self.exit_code = short_by, error, exit_code
        self._proc = self  # run_cell asks `server._proc.poll()` whether vLLM still runs

    def poll(self) -> int | None:
        return self.exit_code

    def post(self, path: str, body: dict[str, Any], timeout: float = 0) -> dict[str, Any]:
        assert path == "/v1/completions"
        self.bodies.append(body)
        if self.error is not None:
            raise self.error
        return {"usage": {"prompt_tokens": len(body["prompt"]),
                          "completion_tokens": body["max_tokens"] - self.short_by}}


def test_a_cell_sends_its_requests_and_checks_every_answer() -> None:
    from vllm_piep.calibrate.campaign.load import _CellFailed, run_cell
    from vllm_piep.tools.server import ServerError

    plan = CampaignPlan(model="/m", tp=[1], batch=[3], out_len=[4])
    server = StubServer()
    cell = run_cell(server, plan, "b3-o4", 3, 4, attempt=2, vocab=50)  # type: ignore[arg-type]
    assert (cell.requests, cell.prompt_tokens, cell.completion_tokens, cell.attempt) == \
        (3, 3 * 128, 12, 2)
    assert 0 < cell.start_ns <= cell.end_ns
    assert sorted(map(str, (b["prompt"] for b in server.bodies))) == \
        sorted(str(prompt_ids(0, "b3-o4", i, 128, 50)) for i in range(3))
    assert all((b["max_tokens"], b["ignore_eos"], b["temperature"]) == (4, True, 0)
               for b in server.bodies)
    failing = [(StubServer(short_by=1), "request \\d returned 128 prompt and 3 completion "
                                        "tokens, expected 128 and 4"),
               (StubServer(error=ServerError("HTTP 500")), "a request failed: ServerError"),
               (StubServer(exit_code=1), "the vLLM server process exited")]
    for stub, message in failing:
        with pytest.raises(_CellFailed, match=f"cell b3-o4: {message}"):
            run_cell(stub, plan, "b3-o4", 3, 4, attempt=1, vocab=50)  # type: ignore[arg-type]


def test_a_meter_that_cannot_start_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`run --meter nvml` without NVML (a stand-in `pynvml` whose nvmlInit fails as without
    the driver): one line naming --meter nvml and why, exit 2, the output directory never made.
    The same stand-in with its GPU passes the check."""
    from support.cli_checks import check_usage_error
    from support.fake_pynvml import FakeGpu, FakeNvml

    from vllm_piep.calibrate.__main__ import main
    from vllm_piep.calibrate.campaign.driver import check_meter

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 2048}')
    out = tmp_path / "campaign"
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([FakeGpu()], missing=True))
    sigterm = signal.getsignal(signal.SIGTERM)  # run_command turns SIGTERM into SystemExit
    try:
        check_usage_error(main, ["run", "--model", str(model), "--out", str(out), "--quick",
                                 "--meter", "nvml", "--no-progress"],
                          "python -m vllm_piep.calibrate run", "--meter nvml: the meter "
                          "cannot start here (nvml: NVML is not usable", capsys)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert not out.exists()
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([FakeGpu(update_period_s=0.01)]))
    check_meter(CampaignPlan.quick(str(model)).model_copy(update={"meter": "nvml"}))


@pytest.mark.parametrize("meter,refused", [
    ("amdsmi", None), ("external:/var/log/power.csv", None), ("mod:make_meter", None),
    ("external", "`external:PATH`"), ("wattmeter", "amdsmi"),
])
def test_the_plan_takes_the_meter_settings_serving_takes(meter: str, refused: str | None
                                                         ) -> None:
    if refused is None:
        assert CampaignPlan(model="/m", tp=[1], meter=meter).meter == meter  # not built
    else:
        with pytest.raises(ValidationError, match=refused):
            CampaignPlan(model="/m", tp=[1], meter=meter)
