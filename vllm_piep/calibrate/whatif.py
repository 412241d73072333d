"""What-if: predicted energy per output token against time per output token across tensor-
parallel degrees and batch sizes, from a campaign bundle (PIE-P §5.2, Fig. 3).

For each (TP, batch) a decode step of `batch` requests at context `context` is predicted: its
time by the bundle's step-time model, its energy by the bundle (leaves + static power over that
time). Every request gets one token per step, so time per output token is the step time and
energy per output token the step's energy over the batch. A degree the campaign did not
measure is predicted from the nearest measured configuration's tree, waits and idle power;
the output names it (`measured_config`).

The measured grid is the campaign's: the TP degrees with a tree template in the manifest
(`serving.templates`) and the batch sizes and contexts of the `run` command that made it
(`how_to_remake`, read with `run`'s own flags and the `--quick` preset). A point outside it is
`extrapolated`; one beyond `EXTRAPOLATION_FACTOR` times it (or below the smallest measured TP,
or at a PP degree not measured) is refused with a `UsageError`.

The step-time and leaf models are fitted regressions, which leave their measured range badly
(a linear step time turns negative at large batches). No point is shown below what physics
allows, given a decode step's cost `a + c * batch` with `a, c >= 0` (fixed per-step work plus
per-request work):

* time at a measured TP: not below the step time at any measured batch <= `batch` (more
  requests are more work), nor below `t(m) * batch / m` at any measured batch m >= `batch`
  (time per request does not grow as requests are removed);
* time at an unmeasured TP: not below the bounded time at the largest measured TP below it
  times `tp_measured / tp` (splitting the work over more ranks at best divides the time);
* energy: not below the idle power times the step time (dynamic energy is never negative),
  nor, at a measured TP, below the step energy at any measured batch <= `batch`.

Where a bound replaces the model's value the row says so (`time_floored`, `energy_floored`).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vllm_piep.cli_errors import UsageError
from vllm_piep.model.components import STATIC
from vllm_piep.model.flops import ModelShape, StepBatch, StepTotals
from vllm_piep.predict.base import StepInput
from vllm_piep.predict.bundle import TreeBundle, _session
from vllm_piep.predict.served import BundlePredictor, Serving, parse_config, step_nodes

# How far past the measured grid a point is still predicted (and marked extrapolated): batch
# and context up to 4x the largest measured (down to a quarter of the smallest), TP up to 4x.
EXTRAPOLATION_FACTOR = 4


@dataclasses.dataclass(frozen=True)
class MeasuredGrid:
    """What the campaign behind a bundle measured."""

    tp: tuple[int, ...]
    pp: tuple[int, ...]
    batch: tuple[int, ...]
    context: tuple[int, int]  # prompt tokens .. prompt + longest output

    def as_dict(self) -> dict[str, list[int]]:
        return {"tp": list(self.tp), "pp": list(self.pp), "batch": list(self.batch),
                "context": list(self.context)}


def measured_grid(manifest: dict[str, Any], where: str) -> MeasuredGrid:
    """The grid of the campaign that made a bundle (module docstring); a UsageError naming
    the manifest field when it does not say."""
    from pydantic import ValidationError

    from vllm_piep.calibrate.campaign.cli import add_run_arguments, plan_from_args

    layouts = [parse_config(c) for c in manifest.get("serving", {}).get("templates", {})]
    command = str(manifest.get("how_to_remake", ""))
    words = shlex.split(command, comments=True)
    if not layouts or "run" not in words:
        raise UsageError(f"{where}: how_to_remake {command!r} is not a `calibrate run` command "
                         "(or serving.templates is empty), so the campaign's measured grid is "
                         "unknown; whatif needs a campaign bundle")
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_run_arguments(parser)
    try:
        args, _ = parser.parse_known_args(words[words.index("run") + 1:])
        plan = plan_from_args(args)
    except (argparse.ArgumentError, ValidationError, ValueError) as exc:
        raise UsageError(f"{where}: how_to_remake {command!r} is not a valid `calibrate run` "
                         f"command ({exc})") from None
    return MeasuredGrid(tp=tuple(sorted({t for t, _ in layouts})),
                        pp=tuple(sorted({p for _, p in layouts})),
                        batch=tuple(sorted(plan.batch)),
                        context=(plan.prompt_tokens, plan.prompt_tokens + max(plan.out_len)))


def check_request(grid: MeasuredGrid, tps: Sequence[int], batches: Sequence[int],
                  context: int, pp: int) -> None:
    """Refuse what lies beyond `EXTRAPOLATION_FACTOR` times the measured grid."""
    f = EXTRAPOLATION_FACTOR
    measured = f"the campaign measured TP {list(grid.tp)}, PP {list(grid.pp)}, batch " \
               f"{list(grid.batch)}, context {grid.context[0]}-{grid.context[1]}"
    if pp not in grid.pp:
        raise UsageError(f"--pp {pp}: not measured ({measured}); whatif extrapolates TP and "
                         "batch, not PP")
    for tp in tps:
        if tp < min(grid.tp) or tp > f * max(grid.tp):
            raise UsageError(f"--tp {tp}: outside {min(grid.tp)}..{f * max(grid.tp)} "
                             f"(from the smallest measured TP to {f}x the largest; {measured})")
    lo, hi = min(grid.batch), max(grid.batch)
    for b in batches:
        if b * f < lo or b > f * hi:
            raise UsageError(f"--batch {b}: outside {max(1, -(-lo // f))}..{f * hi} "
                             f"({f}x the measured range at most; {measured})")
    c_lo, c_hi = grid.context
    if context * f < c_lo or context > f * c_hi:
        raise UsageError(f"--context {context}: outside {max(1, -(-c_lo // f))}..{f * c_hi} "
                         f"({f}x the measured range at most; {measured})")


@dataclasses.dataclass
class _Point:
    seconds: float  # the step-time model's value
    joules: np.ndarray  # per component at `seconds` (not yet bounded)


class _Pricer:
    """Raw predictions of one bundle at one TP degree."""

    def __init__(self, bundle: TreeBundle, bundle_dir: Path, shape: ModelShape,
                 context: int) -> None:
        timing = bundle.manifest["serving"]["step_time"]
        self.timer = _session(bundle_dir / timing["file"])
        self.features = timing["features"]
        self.shape = shape
        self.context = context
        self.predictor = BundlePredictor(bundle, shape)

    def step(self, batch: int) -> StepBatch:
        return StepBatch.from_rows([(0, 1, self.context, 1)] * int(batch))

    def seconds(self, batch: int) -> float:
        nodes = step_nodes(self.predictor.template, self.shape, StepTotals.of(self.step(batch)),
                           float(batch), self.predictor.wait_s)
        root = nodes[nodes.parent_id == ""][self.features].to_numpy(np.float64)
        return float(np.asarray(self.timer.run(None, {"X": root})[0]).reshape(-1)[0])

    def joules(self, batch: int, seconds: float) -> np.ndarray:
        return np.asarray(self.predictor.predict_step(
            StepInput(self.step(batch), seconds)).joules, dtype=np.float64)


def _batch_time_floor(raw: dict[int, float], batch: int) -> float:
    """The lower bound on the step time at `batch` from the times at measured batches (module
    docstring); 0 where no measured batch bounds it."""
    below = [t for m, t in raw.items() if m <= batch]
    above = [t * batch / m for m, t in raw.items() if m >= batch]
    return max([0.0, *below, *above])


def whatif_table(bundle_dir: str | Path, tps: Sequence[int] | None = None,
                 batches: Sequence[int] | None = None, context: int | None = None,
                 pp: int = 1) -> pd.DataFrame:
    """One row per (TP, batch): time and energy per output token (bounded below, see the
    module docstring), whether the point is extrapolated, and the configuration it comes
    from. Defaults: the measured TP degrees and batches, the middle of the measured contexts.
    The frame's attrs hold the bundle id, its meter and the measured grid."""
    directory = Path(bundle_dir)
    bundle = TreeBundle.load(directory)
    grid = measured_grid(bundle.manifest, str(directory / "manifest.json"))
    tps = list(tps) if tps else list(grid.tp)
    batches = list(batches) if batches else list(grid.batch)
    context = int(context) if context else (grid.context[0] + grid.context[1]) // 2
    check_request(grid, tps, batches, context, pp)
    base = ModelShape(**bundle.manifest["serving"]["shape"])

    def pricer(tp: int) -> _Pricer:
        return _Pricer(bundle, directory, dataclasses.replace(base, tp=int(tp), pp=int(pp)),
                       context)

    measured_tp = {tp: pricer(tp) for tp in grid.tp}
    reference = {tp: {m: _Point(s, p.joules(m, s)) for m in grid.batch
                      for s in [p.seconds(m)]} for tp, p in measured_tp.items()}
    for tp, points in reference.items():
        for m, point in points.items():
            if not point.seconds > 0:
                raise UsageError(f"{directory}: the step-time model predicts "
                                 f"{point.seconds:.3g} s at the measured TP {tp}, batch {m}: "
                                 "the bundle is broken; remake it (how_to_remake)")

    def bounded_seconds(tp: int, batch: int, raw: float) -> float:
        if tp in reference:
            floor = _batch_time_floor({m: p.seconds for m, p in reference[tp].items()}, batch)
            return raw if batch in reference[tp] else max(raw, floor)
        below = max(t for t in grid.tp if t < tp)
        at_below = bounded_seconds(below, batch, measured_tp[below].seconds(batch))
        return max(raw, at_below * below / tp)

    c_lo, c_hi = grid.context
    rows = []
    for tp in tps:
        p = measured_tp.get(tp) or pricer(tp)
        for batch in batches:
            raw = p.seconds(batch)
            seconds = bounded_seconds(tp, batch, raw)
            joules = p.joules(batch, seconds)
            static_j = float(joules[STATIC])
            energy_floor = static_j  # the idle power over the step: dynamic energy >= 0
            if tp in reference:
                energy_floor = max([energy_floor] + [float(r.joules.sum()) for m, r in
                                                     reference[tp].items() if m <= batch])
            total = float(joules.sum())
            step_j = max(total, energy_floor)
            extrapolated = (tp not in grid.tp or not grid.batch[0] <= batch <= grid.batch[-1]
                            or not c_lo <= context <= c_hi)
            rows.append({"tp": int(tp), "pp": int(pp), "batch": int(batch),
                         "context_tokens": context, "measured_config": p.predictor.template_config,
                         "extrapolated": bool(extrapolated),
                         "time_per_token_ms": seconds * 1e3,
                         "tokens_per_s": batch / seconds,
                         "joules_per_token": step_j / batch,
                         "static_share": static_j / step_j,
                         "time_floored": bool(seconds > raw),
                         "energy_floored": bool(step_j > total)})
    out = pd.DataFrame(rows)
    out.attrs["meter"] = Serving.of(bundle.manifest).meter
    out.attrs["bundle_id"] = bundle.bundle_id
    out.attrs["measured"] = grid.as_dict()
    return out


def plot_whatif(table: pd.DataFrame, path: str | Path) -> Path:
    """Time against energy per output token, one line per TP degree: filled markers and solid
    lines inside the measured grid, hollow markers and dashed lines outside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for tp, g in table.groupby("tp"):
        g = g.sort_values("batch")
        line, = ax.plot(g.time_per_token_ms, g.joules_per_token, linestyle="--", alpha=0.6)
        color = line.get_color()
        inside = g[~g.extrapolated]
        if len(inside) > 1:
            ax.plot(inside.time_per_token_ms, inside.joules_per_token, color=color)
        ax.scatter(inside.time_per_token_ms, inside.joules_per_token, color=color,
                   label=f"TP {tp}" + ("" if g.measured_config.iloc[0].startswith(f"tp{tp}-")
                                       else f" (from {g.measured_config.iloc[0]})"))
        outside = g[g.extrapolated]
        if not outside.empty:
            ax.scatter(outside.time_per_token_ms, outside.joules_per_token,
                       facecolors="none", edgecolors=color)
        for r in g.itertuples():
            floored = "≥" if r.time_floored or r.energy_floored else ""
            ax.annotate(f"b{r.batch}{floored}", (r.time_per_token_ms, r.joules_per_token),
                        textcoords="offset points", xytext=(4, 3), fontsize=7)
    if table.extrapolated.any():
        ax.scatter([], [], facecolors="none", edgecolors="grey", label="extrapolated")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("time per output token (ms)")
    ax.set_ylabel("energy per output token (J)")
    grid = table.attrs.get("measured", {})
    ax.set_title(f"what-if: {table.attrs.get('bundle_id', '')}, meter: "
                 f"{table.attrs.get('meter', '')}\nmeasured TP {grid.get('tp')}, batch "
                 f"{grid.get('batch')}; b≥: a lower bound replaced the model's value",
                 fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
