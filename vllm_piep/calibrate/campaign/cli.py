"""Command line (`python -m vllm_piep.calibrate run`): the flags, the plan they give, and the
exit status of a campaign."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console

from vllm_piep.calibrate.campaign.driver import run_campaign
from vllm_piep.calibrate.campaign.plan import CampaignError, CampaignPlan
from vllm_piep.calibrate.campaign.state import STATE_FILE
from vllm_piep.cli_errors import UsageError, one_line
from vllm_piep.tools.server import exit_on_sigterm


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (>= 1)")
    return value


def int_list(text: str) -> list[int]:
    """An argparse type: a comma-separated list of distinct positive integers, e.g. 1,2,4."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    try:
        values = [int(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         f"integers (e.g. 1,2,4)") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give at least one integer")
    bad = [v for v in values if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: {bad} not positive, expected integers "
                                         f">= 1")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} lists a value twice")
    return values


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The `run` flags. Without --quick, unset flags take CampaignPlan's defaults; with it,
    the quick preset's, and the flags given explicitly go on top."""
    d = {name: f.get_default(call_default_factory=True)
         for name, f in CampaignPlan.model_fields.items() if name != "model"}
    q = CampaignPlan.quick("-")

    def default(name: str) -> str:
        def show(v: object) -> str:
            return ",".join(map(str, v)) if isinstance(v, list) else str(v)
        return f"(default: {show(d[name])}; with --quick: {show(getattr(q, name))})"

    parser.add_argument("--model", required=True, help="model directory (a Hugging Face "
                        "layout)")
    parser.add_argument("--out", required=True, help="campaign directory")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid for a CPU machine (tp 1,2; batch 1,4; out-len 16,48)")
    parser.add_argument("--resume", action="store_true",
                        help="go on with the campaign in --out (same options as its first run)")
    parser.add_argument("--tp", type=int_list, help=f"tensor-parallel sizes {default('tp')}")
    parser.add_argument("--pp", type=int_list, help=f"pipeline-parallel sizes {default('pp')}")
    parser.add_argument("--batch", type=int_list,
                        help=f"concurrent requests per cell {default('batch')}")
    parser.add_argument("--out-len", type=int_list,
                        help=f"output tokens per request {default('out_len')}")
    parser.add_argument("--prompt-tokens", type=positive_int,
                        help=f"prompt tokens per request {default('prompt_tokens')}")
    parser.add_argument("--meter", help="auto, nvml, amdsmi (AMD SMI), rapl, nvml+rapl, "
                        "cpu-estimate, simulated, external:PATH (a wall meter's CSV log, Unix "
                        "epoch seconds on this host's clock) or module:callable, as the serving "
                        "option `meter`; refused before anything is written if it cannot start "
                        f"here {default('meter')}")
    parser.add_argument("--meter-interval", type=float, dest="meter_interval_s",
                        help=f"seconds between meter readings {default('meter_interval_s')}")


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
    """`run`: the exit status: 0 finished, 130 interrupted by Ctrl-C or SIGTERM (the server
    stopped, the state saved); a refused plan or a failed campaign is a `UsageError` whose
    message says why (the CLI prints it as one line and exits 2)."""
    try:
        plan = plan_from_args(args)
    except ValidationError as exc:
        messages = "; ".join(str(e.get("msg", e)) for e in exc.errors())
        raise UsageError(f"invalid plan: {messages}") from None
    exit_on_sigterm()  # SIGTERM stops the server like Ctrl-C does
    try:
        run_campaign(plan, Path(args.out), resume=args.resume, console=console)
    except CampaignError as exc:
        raise UsageError(one_line(str(exc))) from None
    except (KeyboardInterrupt, SystemExit):
        console.print(f"interrupted; the finished cells are saved in {args.out}/{STATE_FILE}: "
                      f"rerun with --resume to go on")
        return 130
    return 0
