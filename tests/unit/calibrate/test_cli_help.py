"""Every option of every `python -m vllm_piep.calibrate` subcommand has help text, and --help
shows the default of every option that has one."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from support.cli_checks import check_options_documented

from vllm_piep.calibrate.__main__ import parser


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


SUBCOMMANDS = _subcommands()


def test_there_are_subcommands_to_check() -> None:
    assert {"run", "finish", "whatif", "evaluate", "train", "report", "from-metrics",
            "fit-prior", "validate-prior"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_has_help_and_its_default(name: str) -> None:
    check_options_documented(name, SUBCOMMANDS[name])


@pytest.mark.slow
def test_help_runs_for_every_subcommand() -> None:
    for name in SUBCOMMANDS:
        proc = subprocess.run([sys.executable, "-m", "vllm_piep.calibrate", name, "--help"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "default" in proc.stdout or name in ("finish", "report")


def test_run_lists_every_meter_setting() -> None:
    from vllm_piep.meters.setting import METER_NAMES

    text = " ".join(SUBCOMMANDS["run"].format_help().split())
    for name in METER_NAMES:
        assert name in text, name
    assert "AMD SMI" in text and "external:PATH" in text and "module:callable" in text
