"""`calibrate fit-prior` and `calibrate validate-prior`: the prior's GPU powers fitted to
published measurements, and the served prior checked against them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console
from rich.table import Table

from vllm_piep.calibrate.errors import FitError
from vllm_piep.calibrate.published import load_deployments
from vllm_piep.model.devices import FIT_FILE, gpu_profile_key, power_fits

if TYPE_CHECKING:
    import pandas as pd

    from vllm_piep.calibrate.published import Deployment
    from vllm_piep.model.devices import PowerFit

# Short, for the table; the summary and docs/prior.md say what each is.
_LABELS = {"served": "served prior", "lomo": "prior, LOMO", "roofline": "roofline (datasheet)",
           "tdp_fraction": "TDP fraction x time", "wilkins": "Wilkins J/token"}


def add_arguments(sub: argparse._SubParsersAction,
                  formatter: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> None:
    what = "fit the prior's GPU powers to published deployments"
    fit = sub.add_parser("fit-prior", help=what, description=what, formatter_class=formatter)
    fit.add_argument("--data", action="append", required=True,
                     help="an ML.ENERGY leaderboard table (v2 or v3; repeat for several GPUs)")
    fit.add_argument("--structures", required=True, help="model_structures.csv")
    fit.add_argument("--out", default=str(FIT_FILE),
                     help="the fit file the prior reads (default: %(default)s)")
    what = ("price every published deployment as the engine would and compare with the "
            "measurement")
    val = sub.add_parser("validate-prior", help=what, description=what, formatter_class=formatter)
    val.add_argument("--data", required=True, help="an ML.ENERGY leaderboard table (v2 or v3)")
    val.add_argument("--structures", required=True, help="model_structures.csv")
    val.add_argument("--out", default="validate-prior",
                     help="directory for the per-configuration table, summary and plot "
                          "(default: %(default)s)")
    val.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_fit_prior(args: argparse.Namespace, console: Console) -> None:
    from vllm_piep.calibrate import prior_fit as pf  # SciPy: the calibrate extra
    fits: dict[str, dict[str, object]] = {}
    for data in args.data:
        deps, skipped = load_deployments(data, args.structures)
        for line in skipped:
            console.print(f"[yellow]skipped[/] {line}")
        if not deps:
            raise FitError(f"{data}: no configuration could be priced ({len(skipped)} "
                           f"rows skipped, e.g. {skipped[0] if skipped else 'none'})")
        for gpu in sorted({d.gpu for d in deps}):
            mine = [d for d in deps if d.gpu == gpu]
            models = sorted({d.model for d in mine})
            source = (f"fitted to {Path(data).name} (sha256 {pf.file_digest(data)}): "
                      f"{len(mine)} configurations of {len(models)} models on {gpu}")
            fit = pf.fit_power(mine, source)
            pairs = pf.pair_table(mine, fit)
            y = np.array([d.joules_per_token for d in mine])
            pred = np.array([pf.predicted_joules_per_token(d, pf.prior_with(d, fit))
                             for d in mine])
            key = gpu_profile_key(gpu)
            fits[str(key)] = {"run_watts": fit.run_watts,
                              "occupancy_watts": fit.occupancy_watts,
                              "flop_watts": fit.flop_watts, "byte_watts": fit.byte_watts,
                              "eta": fit.eta, "n_half": fit.n_half, "source": source,
                              "in_sample_mape": float(100 * np.abs(pred / y - 1).mean()),
                              "gpu_count_pairs": pf.pair_summary(pairs) if len(pairs) else {},
                              "models": models}
            c = pf.constants(pf.spec_of(gpu), fit)
            console.print(f"{key}: {_constants_text(c)} (in-sample MAPE "
                          f"{fits[str(key)]['in_sample_mape']:.1f} %)")
            if len(pairs):
                console.print(_pair_table(str(key), pairs))
    out = pf.write_fits(fits, Path(args.out))
    power_fits.cache_clear()
    console.print(f"wrote {out}")


def run_validate_prior(args: argparse.Namespace, console: Console) -> None:
    from vllm_piep.calibrate import prior_fit as pf  # SciPy: the calibrate extra
    deps, skipped = load_deployments(args.data, args.structures)
    for line in skipped:
        console.print(f"[yellow]cannot price[/] {line}")
    total = len(deps) + len(skipped)
    if not deps:
        raise FitError(f"{args.data}: no configuration could be priced ({len(skipped)} "
                       f"rows skipped, e.g. {skipped[0] if skipped else 'none'})")
    table = pf.validate(deps, progress=not args.no_progress)
    table["band"] = pf.batch_band(table.batch)
    table["work_band"] = pf.work_band(table.work_per_gpu)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "configurations.csv", index=False)
    overall = pf.summary(table)
    by_group = pf.summary(table, ["gpu", "architecture"])
    by_band = pf.summary(table, ["gpu", "band"])
    by_work = pf.summary(table, ["gpu", "work_band"])
    pairs = {str(gpu_profile_key(gpu)): pf.pair_table(mine, fit)
             for gpu, mine, fit in _served_fits(deps)}
    fitted = _constants(sorted(set(table.gpu)))
    report = {"data": str(args.data), "structures": str(args.structures),
              "coverage": {"priced": len(deps), "rows": total},
              "overall": overall.to_dict("records"), "by_gpu_architecture":
              by_group.to_dict("records"), "by_gpu_batch_band": by_band.to_dict("records"),
              "by_gpu_work_band": by_work.to_dict("records"),
              "gpu_count_pairs": {k: {**pf.pair_summary(v), "rows": v.to_dict("records")}
                                  for k, v in pairs.items() if len(v)},
              "constants": fitted, "skipped": skipped}
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    png = pf.plot(table, out / "predicted_vs_measured.png",
                  f"{Path(args.data).name}: J per output token, {len(deps)} configurations")
    t = Table(title=f"{Path(args.data).name}: {len(deps)} of {total} configurations priced "
                    f"({100 * len(deps) / total:.0f} %), J per output token")
    for col in ("group", "method", "n", "MAPE", "median signed", "within ±20 %"):
        t.add_column(col, justify="right" if col not in ("group", "method") else "left")
    for frame, label in ((overall, lambda r: "all"),
                         (by_group, lambda r: f"{gpu_profile_key(r['gpu'])} "
                                              f"{r['architecture']}")):
        for r in frame.to_dict("records"):
            t.add_row(label(r), _LABELS[r["method"]], str(r["n"]), f"{r['mape']:.1f} %",
                      f"{r['median_signed']:+.1f} %", f"{r['within_20']:.0f} %")
    console.print(t)
    console.print(_band_table(by_band, "band", "batch",
                              "by batch size (requests per engine step): median signed error / "
                              "MAPE"))
    console.print(_band_table(by_work, "work_band", "work per GPU",
                              "by work per GPU (the step's work at peak rates over G x T): "
                              "median signed error / MAPE"))
    for key, frame in pairs.items():
        if len(frame):
            console.print(_pair_table(key, frame))
    for key, c in fitted.items():
        console.print(f"{key}: the served prior's constants: {_constants_text(c)}")
    console.print(f"wrote {out / 'configurations.csv'}, {out / 'summary.json'}, {png}")


def _constants_text(c: dict[str, float]) -> str:
    return (f"idle {c['idle_w']:.0f} W per GPU (the profile's reading); above it while kernels "
            f"run {c['run_w']:.1f} W, and up to {c['occupancy_w']:.1f} W more as requests "
            f"fill the GPU (half at {c['n_half']:g} per GPU; busy = work at peak / "
            f"{c['eta']:g}); {c['pj_per_flop']:.3f} pJ/FLOP, {c['pj_per_byte']:.1f} pJ/B of "
            f"memory traffic, {c['pj_per_link_byte']:.1f} pJ/B over the link")


def _constants(gpus: list[str]) -> dict[str, dict[str, float]]:
    """The served prior's constants in physical units for each GPU that has a power fit."""
    from vllm_piep.calibrate import prior_fit as pf
    from vllm_piep.model.devices import GPU_SPECS, power_fit

    out = {}
    for gpu in gpus:
        key = gpu_profile_key(gpu)
        spec = GPU_SPECS.get(str(key))
        fit = power_fit(spec) if spec is not None else None
        if spec is not None and fit is not None:
            out[str(key)] = pf.constants(spec, fit)
    return out


def _served_fits(deps: list[Deployment]) -> list[tuple[str, list[Deployment], PowerFit]]:
    """Per GPU with a power fit: its deployments and the fit the engine serves."""
    from vllm_piep.calibrate import prior_fit as pf
    from vllm_piep.model.devices import power_fit

    out = []
    for gpu in sorted({d.gpu for d in deps}):
        fit = power_fit(pf.spec_of(gpu))
        if fit is not None:
            out.append((gpu, [d for d in deps if d.gpu == gpu], fit))
    return out


def _pair_table(key: str, pairs: pd.DataFrame) -> Table:
    """Each GPU-count pair's measured and predicted ratio of power per GPU."""
    from vllm_piep.calibrate import prior_fit as pf

    s = pf.pair_summary(pairs)
    t = Table(title=f"{key}: the same model, task and request limit on more GPUs, power per GPU "
                    f"over that on fewer: median {s['median_error_pct']:+.1f} %, worst "
                    f"{s['worst_error_pct']:.1f} %, {s['beyond']} of {s['pairs']} beyond "
                    f"±{s['within_pct']:g} %")
    for col in ("model", "task", "limit", "GPUs", "measured", "predicted", "error"):
        # Names wrap rather than being cut short in a narrow terminal.
        t.add_column(col, justify="left" if col in ("model", "task") else "right",
                     overflow="fold")
    for r in pairs.to_dict("records"):
        t.add_row(r["model"], r["task"], f"{r['max_batch']:g}", r["gpus"],
                  f"{r['measured']:.3f}", f"{r['predicted']:.3f}", f"{r['error_pct']:+.1f} %")
    return t


def _band_table(by_band: pd.DataFrame, column: str, label: str, title: str) -> Table:
    """Median signed error and MAPE per GPU and band: served prior and LOMO."""
    t = Table(title=title)
    for col in ("GPU", label, "n", "served prior", "prior, LOMO"):
        t.add_column(col, justify="left" if col == "GPU" else "right")
    cells = {(r["gpu"], r[column], r["method"]): r for r in by_band.to_dict("records")}
    for gpu, band in dict.fromkeys((g, b) for g, b, _ in cells):
        served, lomo = cells[(gpu, band, "served")], cells[(gpu, band, "lomo")]
        t.add_row(str(gpu_profile_key(gpu)), str(band), str(served["n"]),
                  f"{served['median_signed']:+.1f} % / {served['mape']:.1f} %",
                  f"{lomo['median_signed']:+.1f} % / {lomo['mape']:.1f} %")
    return t
