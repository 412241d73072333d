"""Command line (`python -m vllm_piep.calibrate run`): the flags, the plan they give, and the
exit status of a campaign."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from vllm_piep.calibrate.campaign.driver import run_campaign
from vllm_piep.calibrate.campaign.plan import CampaignError, CampaignPlan
from vllm_piep.calibrate.campaign.state import STATE_FILE
from vllm_piep.tools.server import exit_on_sigterm


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         f"integers") from exc


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The `run` flags. Without --quick, unset flags take CampaignPlan's defaults; with it,
    the quick preset's, and the flags given explicitly go on top."""
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--out", required=True, help="campaign directory")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid for a CPU machine (tp 1,2; batch 1,4; out-len 16,48)")
    parser.add_argument("--resume", action="store_true",
                        help="go on with the campaign in --out (same options as its first run)")
    parser.add_argument("--tp", type=int_list, help="tensor-parallel sizes, e.g. 1,2,4")
    parser.add_argument("--pp", type=int_list, help="pipeline-parallel sizes, e.g. 1,2")
    parser.add_argument("--batch", type=int_list, help="concurrent requests, e.g. 8,16,32")
    parser.add_argument("--out-len", type=int_list, help="output tokens, e.g. 512,1024")
    parser.add_argument("--prompt-tokens", type=int, help="prompt tokens per request")
    parser.add_argument("--meter", help="auto, nvml, rapl, cpu-estimate, external, simulated")
    parser.add_argument("--meter-interval", type=float, dest="meter_interval_s",
                        help="seconds between meter readings")


_PLAN_FLAGS = ("tp", "pp", "batch", "out_len", "prompt_tokens", "meter", "meter_interval_s")


def plan_from_args(args: argparse.Namespace) -> CampaignPlan:
    base = CampaignPlan.quick(args.model) if args.quick else None
    given = {k: getattr(args, k) for k in _PLAN_FLAGS if getattr(args, k, None) is not None}
    if base is None:
        return CampaignPlan(model=args.model, **given)
    fields = base.model_dump()
    if "prompt_tokens" in given or "out_len" in given:
        fields["max_model_len"] = None  # recomputed for the new lengths
    return CampaignPlan(**{**fields, **given})


def run_command(args: argparse.Namespace, console: Console) -> int:
    """`run`: the exit status: 0 finished, 2 refused or failed (the message says why), 130
    interrupted by Ctrl-C or SIGTERM (the server stopped, the state saved)."""
    exit_on_sigterm()  # SIGTERM stops the server like Ctrl-C does
    try:
        plan = plan_from_args(args)
        run_campaign(plan, Path(args.out), resume=args.resume, console=console)
    except ValidationError as exc:
        messages = "; ".join(str(e.get("msg", e)) for e in exc.errors())
        console.print(f"[red]error:[/] invalid plan: {escape(messages)}")
        return 2
    except CampaignError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    except (KeyboardInterrupt, SystemExit):
        console.print(f"interrupted; the finished cells are saved in {args.out}/{STATE_FILE}: "
                      f"rerun with --resume to go on")
        return 130
    return 0
