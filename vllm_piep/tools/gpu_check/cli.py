"""`scripts/gpu_check.py`'s command line: every section (the parent), or one (a child)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from vllm_piep.cli_errors import HelpFormatter, OneLineParser, UsageError, run_cli
from vllm_piep.tools.gpu_check.backend import Backend
from vllm_piep.tools.gpu_check.runner import BY_NAME, run_all, run_section

PROG = "scripts/gpu_check.py"
# A dry run's sections run on this CPU, which other work may share: their budgets, sized for a
# GPU machine running the check alone, are this many times longer.
DRY_RUN_BUDGET_SCALE = 3.0


def _sections(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown or [text]}; known: "
                                         f"{', '.join(BY_NAME)}")
    return names


def _budget(text: str) -> tuple[str, float]:
    name, sep, seconds = text.partition("=")
    if not sep or name not in BY_NAME:
        raise argparse.ArgumentTypeError(f"{text!r}: expected SECTION=SECONDS, a section of "
                                         f"{', '.join(BY_NAME)}")
    return name, _positive(seconds)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive number")
    return value


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, formatter_class=HelpFormatter,
                      description="The plugin's GPU parts against a real GPU "
                                  "(docs/gpu-validation.md).")
    p.add_argument("--out", type=Path, default=Path("gpu-check-results"),
                   help="folder for the sections' JSON, summary.json and the log")
    p.add_argument("--dry-run", action="store_true",
                   help="run on this CPU against stand-ins (tests/support): checks the check, "
                        "measures nothing")
    p.add_argument("--sections", type=_sections, default=None,
                   help=f"comma-separated sections to run (default: all: {', '.join(BY_NAME)})")
    p.add_argument("--budget-scale", type=_positive, default=1.0,
                   help="multiply every section's time budget (a slow machine)")
    p.add_argument("--budget", type=_budget, action="append", default=[],
                   metavar="SECTION=SECONDS", help="one section's time budget; repeatable")
    p.add_argument("--section", choices=list(BY_NAME), default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str], make_backend: Callable[[], Backend], child: list[str]) -> int:
    """`child`: the command that starts this entry point again (one section per process)."""
    args = parser().parse_args(argv)

    def run() -> int:
        if args.section:
            return run_section(args.section, args.out, make_backend, args.dry_run)
        if args.out.exists() and not args.out.is_dir():
            raise UsageError(f"--out {args.out}: not a folder")
        scale = args.budget_scale * (DRY_RUN_BUDGET_SCALE if args.dry_run else 1.0)
        return run_all(args.out, child + (["--dry-run"] if args.dry_run else []),
                       args.dry_run, args.sections, scale, dict(args.budget))

    return run_cli(PROG, run)
