"""After the profiling: dataset, evaluation, bundle and report of a campaign directory.

    OUT/dataset/     the TreeDataset (nodes/trees parquet) + samples, sync quantiles, idle power
    OUT/evaluation/  one JSON (+ predictions parquet) per protocol (kfold, leave-one-batch-out,
                     leave-one-tp-out); interval.json (+ interval.residuals.parquet): the
                     prediction interval of the step energy and its measured coverage
    OUT/bundle/      the ONNX bundle with its manifest (`serving` section for `vllm serve`,
                     with the interval as `serving.interval`)
    OUT/report/      index.html + PNGs: the 3-fold evaluation, the interval's residuals,
                     wait-time distributions, the repeated-sampling spread, and the what-if plot
"""

from __future__ import annotations

import html
import json
import platform
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vllm_piep.calibrate import conformal
from vllm_piep.calibrate.campaign_data import CampaignData, build_campaign_data
from vllm_piep.calibrate.campaign_train import (
    campaign_interval,
    evaluate_campaign,
    portable_model,
    train_bundle,
)
from vllm_piep.cli_errors import UsageError, existing_file
from vllm_piep.predict.base import fit_warning
from vllm_piep.predict.loader import device_name_of
from vllm_piep.predict.served import meter_of_label
from vllm_piep.spans.reader import read_span_header, span_files


def host_device() -> tuple[str, str]:
    """(device type, name) of this host, as the serve path will see it: the first GPU NVML
    names, else the CPU's model name."""
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return "cuda", name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # no NVML, no driver, no GPU: a CPU host
        return "cpu", device_name_of("cpu", None)


def _first_header(out: Path, state: dict[str, Any]) -> dict[str, Any]:
    for entry in state["configs"].values():
        for attempt in entry.get("attempts", []):
            files = span_files(out / attempt["dir"] / "spans")
            if files:
                return read_span_header(files[0]).model_dump()
    raise FileNotFoundError(f"{out}: no span file in any attempt")


def read_campaign_state(out: Path) -> dict[str, Any]:
    """`OUT/campaign.json` as a dict, checked against its schema; a UsageError naming the file
    and the first bad field otherwise."""
    from pydantic import ValidationError

    from vllm_piep.calibrate.campaign.state import SCHEMA, STATE_FILE, CampaignState

    if not out.is_dir():
        raise UsageError(f"{out}: no such campaign directory")
    path = existing_file(out / STATE_FILE, f"campaign state ({STATE_FILE} of `calibrate run`)")
    try:
        state = CampaignState.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise UsageError(f"{path}: {'field ' + loc + ': ' if loc else ''}{first['msg']} "
                         f"({exc.error_count()} problem(s)); expected the state "
                         "`calibrate run` writes") from None
    if state.schema_ != SCHEMA:
        raise UsageError(f"{path}: schema {state.schema_!r}, expected {SCHEMA!r}")
    return dict(json.loads(path.read_text()))


def finish_campaign(out: Path, console: Console | None = None, progress: bool = True,
                    command: str | None = None) -> dict[str, Any]:
    console = console or Console()
    out = Path(out)
    state = read_campaign_state(out)
    console.print("building the dataset from spans and meter logs ...")
    data = build_campaign_data(out, state)
    data.save(out / "dataset")
    s = data.summary
    console.print(f"dataset: {s['trees']} steps in {len(s['cells'])} cells of {s['configs']}; "
                  f"metered nodes by source {s['metered_nodes_by_source']}")
    for warning in s["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    return finish_data(out, data, _first_header(out, state),
                       command or remake_command(state["plan"]), console, progress)


def finish_data(out: Path, data: CampaignData, header: dict[str, Any], command: str,
                console: Console | None = None, progress: bool = True) -> dict[str, Any]:
    """Evaluation, interval, bundle and report of a campaign's dataset (`finish_campaign`
    after the spans are read; `header`: a span file's header, for the model and its shape)."""
    console = console or Console()
    console.print("evaluating (3-fold, leave one batch size out, leave one TP degree out) ...")
    results = evaluate_campaign(data.dataset, progress)
    evaluation = out / "evaluation"
    evaluation.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Any] = {}
    ground_truth = f"{data.static.meter.iloc[0]}: dynamic energy (idle power subtracted)"
    for protocol, result in results.items():
        predictions = result.pop("_predictions", None)
        result["ground_truth"] = ground_truth
        if predictions is not None:
            name = f"{protocol}.predictions.parquet"
            predictions.to_parquet(evaluation / name, index=False)
            result["predictions_file"] = name
            # null, not NaN, where every node of a level was unpredictable (strict JSON)
            metrics[protocol] = {lv: v["mape"] if np.isfinite(v["mape"]) else None
                                 for lv, v in result["levels"].items()}
        else:
            metrics[protocol] = result
        (evaluation / f"{protocol}.json").write_text(json.dumps(_strict(result), indent=1))
    _print_metrics(results, console)
    interval = write_interval(data, evaluation, console)
    manifest = train_bundle(data, out / "bundle", device=host_device(), header=header,
                            command=command, metrics={"mape_percent": metrics,
                                                      "host": platform.node()},
                            interval=interval.get("interval"))
    console.print(f"bundle: {manifest}")
    meter, kind = meter_of_label(str(data.static.meter.iloc[0]))  # as `serving.meter` says
    warning = None if kind is None else fit_warning("the bundle", meter, kind)
    if warning is not None:
        console.print(f"warning: {escape(warning)}", soft_wrap=True)  # one line, unwrapped
    page = write_campaign_report(out, data, results)
    console.print(f"report: {page}")
    return {"bundle": str(manifest.parent), "report": str(page), "metrics": metrics,
            "interval": interval.get("interval"), "summary": data.summary}


INTERVAL_JSON = "interval.json"
INTERVAL_RESIDUALS = "interval.residuals.parquet"


def write_interval(data: CampaignData, evaluation: Path, console: Console) -> dict[str, Any]:
    """evaluation/interval.json: the bundle's `serving.interval` (`campaign_interval`), the
    same coverage split by step instead of by cell (how much shared error per cell matters),
    and the residuals' file; or why there is none (then the bundle has no interval)."""
    console.print("prediction interval (split conformal on out-of-fold step residuals) ...")
    try:
        interval, steps = campaign_interval(data)
    except conformal.ConformalError as exc:
        record: dict[str, Any] = {"skipped": str(exc)}
        (evaluation / INTERVAL_RESIDUALS).unlink(missing_ok=True)  # an earlier finish's
        console.print(f"no interval: {exc}")
    else:
        steps.to_parquet(evaluation / INTERVAL_RESIDUALS, index=False)
        by_step = conformal.split_coverage(steps.residual, interval["level"]).as_dict()
        grouped = conformal.split_coverage(steps.residual, interval["level"], groups=steps.cell)
        record = {
            "interval": interval,
            "coverage_split_by_step": by_step,
            "cells": grouped.units, "distinct_cell_splits": grouped.distinct_splits,
            "steps_scored": "unsampled steps with a metered energy (a sampled step's time "
                            "holds its replays)",
            "residual_median": float(steps.residual.median()),
            "residuals_file": INTERVAL_RESIDUALS,
        }
        c = interval["coverage"]
        console.print(
            f"{interval['level']:.0%} interval: x{interval['lower']:.3f} .. "
            f"x{interval['upper']:.3f} of the predicted step energy ({interval['residuals']} "
            f"residuals); coverage on held-out cells {c['mean']:.3f} "
            f"(p05 {c['p05']:.3f}, p95 {c['p95']:.3f}; by step {by_step['mean']:.3f})")
    (evaluation / INTERVAL_JSON).write_text(json.dumps(_strict(record), indent=1))
    return record


def _strict(value: Any) -> Any:
    """NaN and infinities as null: the evaluation JSON is read by other tools."""
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def remake_command(plan: dict[str, Any]) -> str:
    """The `run` command that profiles this plan again (the sampling options are the
    preset's or the defaults: `run` takes no flags for them)."""
    from vllm_piep.calibrate.campaign import CampaignPlan

    if CampaignPlan.quick(plan["model"]).model_dump() == plan:
        return (f"python -m vllm_piep.calibrate run --quick --model "
                f"{portable_model(plan['model'])} --out DIR")

    def ints(key: str) -> str:
        return ",".join(str(v) for v in plan[key])
    return (f"python -m vllm_piep.calibrate run --model {portable_model(plan['model'])} "
            f"--tp {ints('tp')} "
            f"--pp {ints('pp')} --batch {ints('batch')} --out-len {ints('out_len')} "
            f"--prompt-tokens {plan['prompt_tokens']} --meter {shlex.quote(plan['meter'])} "
            f"--meter-interval {plan['meter_interval_s']} --out DIR"
            f"  # sampling {json.dumps(plan['sampling'])}, idle {plan['idle_s']} s, "
            f"dtype {plan['dtype']}")


METRIC_LEVELS = ("module", "communication", "model")


def _metric_rows(result: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(method, one cell per level of METRIC_LEVELS) for the main method and each baseline of
    one protocol's evaluation: what the console table and the report page both show."""
    methods = [("piep", result["levels"])] + [
        (name, b["levels"]) for name, b in result.get("baselines", {}).items()]
    return [(name, [_cell(levels.get(lv)) for lv in METRIC_LEVELS]) for name, levels in methods]


def _print_metrics(results: dict[str, Any], console: Console) -> None:
    table = Table(title="held-out MAPE % (dynamic energy)")
    table.add_column("protocol")
    table.add_column("method")
    for level in METRIC_LEVELS:
        table.add_column(level, justify="right")
    for protocol, result in results.items():
        if "skipped" in result:
            table.add_row(protocol, "skipped: " + result["skipped"][:60], "", "", "")
            continue
        for name, cells in _metric_rows(result):
            table.add_row(protocol, name, *cells)
    console.print(table)


def _cell(level: dict[str, Any] | None) -> str:
    if not level:
        return "-"
    missing = f" ({level['n_missing']} missing)" if level.get("n_missing") else ""
    mape = level.get("mape")
    value = f"{mape:.1f}" if isinstance(mape, (int, float)) and np.isfinite(mape) else "-"
    return f"{value}{missing}"


# --------------------------------------------------------------------------- report
def write_campaign_report(out: Path, data: CampaignData, results: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_piep.calibrate.report import PAGE_CSS, figure_html
    from vllm_piep.calibrate.whatif import (
        EXTRAPOLATION_FACTOR,
        measured_grid,
        plot_whatif,
        whatif_table,
    )
    from vllm_piep.predict.bundle import TreeBundle

    report = out / "report"
    report.mkdir(parents=True, exist_ok=True)
    sections = [_metrics_section(out, results, report)]
    sections.append(_interval_section(out / "evaluation", report))
    # wait-time distributions (synchronization sampling)
    waits = data.sync
    if not waits.empty:
        fig, ax = plt.subplots(figsize=(7, 3.8))
        qs = [c for c in waits.columns if c.startswith("q")]
        for r in waits.itertuples():
            ax.plot([float(c[1:3]) for c in qs], [getattr(r, c) * 1e6 for c in qs],
                    marker="o", label=f"{r.config} {r.op} (n={r.n})")
        ax.set_xlabel("quantile (%)")
        ax.set_ylabel("per-rank wait (µs)")
        ax.set_title("synchronization sampling: wait at collectives")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(report / "sync_waits.png", dpi=150)
        plt.close(fig)
        sections.append(
            "<h2>Synchronization sampling</h2>"
            + figure_html("sync_waits.png", "Quantiles of each rank's wait at a collective "
                          "(arrival to the last rank's arrival), per configuration and op")
            + waits.to_html(index=False, float_format=lambda v: f"{v:.3g}", border=0))
    # repeated-sampling spread: per node, std/mean of energy per call across windows
    sm = data.samples.dropna(subset=["node_id"])
    if not sm.empty:
        spread = sm.groupby(["config", "tree_id", "node_id"]).joules_per_call.agg(
            lambda v: float(np.std(v) / abs(np.mean(v))) if np.mean(v) else np.nan)
        fig, ax = plt.subplots(figsize=(7, 3.8))
        ax.hist(spread.dropna() * 100, bins=30)
        ax.set_xlabel("spread of energy per call across windows (% of mean)")
        ax.set_ylabel("sampled nodes")
        ax.set_title("repeated sampling")
        fig.tight_layout()
        fig.savefig(report / "sampling_spread.png", dpi=150)
        plt.close(fig)
        sections.append(
            f"<h2>Repeated sampling</h2><p>{len(sm)} windows; median spread "
            f"{np.nanmedian(spread) * 100:.1f} %</p>"
            + figure_html("sampling_spread.png", "Per sampled node, the spread (std/mean) of "
                          "its energy per call across the replay windows"))
    bundle = out / "bundle"
    if (bundle / "manifest.json").is_file():
        # the measured grid plus one extrapolated TP and batch (marked as such)
        try:
            grid = measured_grid(TreeBundle.load(bundle).manifest,
                                 str(bundle / "manifest.json"))
            table = whatif_table(bundle, [*grid.tp, 2 * max(grid.tp)],
                                 [*grid.batch, EXTRAPOLATION_FACTOR * max(grid.batch)])
        except UsageError as exc:  # a bundle whose manifest does not name its grid
            sections.append(f"<h2>What-if</h2><p>not drawn: {html.escape(str(exc))}</p>")
        else:
            plot_whatif(table, report / "whatif.png")
            sections.append(
                "<h2>What-if (predicted)</h2>"
                + figure_html("whatif.png", "Predicted energy per output token against time "
                              "per output token for each TP and batch; hollow points and dashed "
                              "lines are extrapolated beyond the campaign's grid")
                + table.to_html(index=False, float_format=lambda v: f"{v:.4g}", border=0))
    meter = html.escape(str(data.static.meter.iloc[0]))
    page = report / "index.html"
    tmp = report / ".index.html.tmp"
    tmp.write_text(
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>vllm_piep campaign {html.escape(out.resolve().name)}</title>"
        f"<style>{PAGE_CSS}</style></head><body>\n"
        f"<h1>Calibration campaign: {html.escape(out.resolve().name)}</h1>"
        f"<p>meter: {meter} &mdash; energies are dynamic (idle power subtracted)</p>"
        f"{_summary_html(data.summary)}{''.join(sections)}</body></html>\n", encoding="utf-8")
    tmp.replace(page)
    return page


def _summary_html(summary: dict[str, Any]) -> str:
    """The dataset's summary: its scalars as a list, its counts as small tables side by side."""
    def label(key: str) -> str:
        return html.escape(key.replace("_", " "))

    def text(value: Any) -> str:
        return html.escape((", ".join(map(str, value)) or "none") if isinstance(value, list)
                           else str(value))

    facts = "".join(f"<li>{label(k)}: {text(v)}</li>" for k, v in summary.items()
                    if not isinstance(v, dict))
    tables = "".join(
        f"<table style='display:inline-table; margin-right:2em'><tr><th>{label(k)}</th>"
        "<th>n</th></tr>" + "".join(f"<tr><td>{text(a)}</td><td>{text(b)}</td></tr>"
                                    for a, b in v.items()) + "</table>"
        for k, v in summary.items() if isinstance(v, dict))
    return f"<h2>Dataset</h2><ul>{facts}</ul>{tables}"


def _metrics_section(out: Path, results: dict[str, Any], report: Path) -> str:
    """Held-out MAPE per protocol, method and level in one table; each protocol's own page
    (scatters, residuals, error CDF, per model and per type) linked from it."""
    from vllm_piep.calibrate.report import write_report

    rows = []
    for protocol, result in results.items():
        name = html.escape(protocol)
        if "skipped" in result:
            rows.append(f"<tr><td>{name}</td><td colspan='{len(METRIC_LEVELS) + 1}'>skipped: "
                        f"{html.escape(result['skipped'])}</td></tr>")
            continue
        preds_file = out / "evaluation" / str(result.get("predictions_file", ""))
        if result.get("predictions_file") and preds_file.is_file():
            write_report(result, pd.read_parquet(preds_file), report / protocol)
            name = f"<a href='{html.escape(protocol)}/index.html'>{name}</a>"
        for k, (method, cells) in enumerate(_metric_rows(result)):
            tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
            rows.append(f"<tr><td>{name if k == 0 else ''}</td><td>{html.escape(method)}</td>"
                        f"{tds}</tr>")
    head = "".join(f"<th>{lv}</th>" for lv in METRIC_LEVELS)
    return ("<h2>Held-out MAPE (%) of dynamic energy</h2><p>Each protocol links to its page: "
            "predicted against metered, residuals, error CDF, per model and per node type."
            f"</p><table><tr><th>protocol</th><th>method</th>{head}</tr>{''.join(rows)}</table>")


def _interval_section(evaluation: Path, report: Path) -> str:
    """The interval, its coverage (one table) and the residuals' histogram with the interval
    marked, from evaluation/interval.json; a line saying why where there is none."""
    from vllm_piep.calibrate.report import figure_html

    path = evaluation / INTERVAL_JSON
    if not path.is_file():
        return ""
    record = json.loads(path.read_text())
    if "interval" not in record:
        return f"<h2>Prediction interval</h2><p>none: {html.escape(record.get('skipped', ''))}</p>"
    iv = record["interval"]
    rows = [("held-out cells (the bundle's figure)", iv["coverage"]),
            ("held-out steps", record["coverage_split_by_step"])]
    table = "".join(
        f"<tr><td>{name}</td><td>{c['mean']:.3f}</td><td>{c['p05']:.3f} &ndash; "
        f"{c['p95']:.3f}</td><td>{c['repeats']}</td></tr>" for name, c in rows)
    png = _plot_residuals(evaluation / record["residuals_file"], iv, report / "interval.png")
    return (
        f"<h2>Prediction interval ({iv['level']:.0%})</h2>"
        f"<p>predicted step energy &times; [{iv['lower']:.3f}, {iv['upper']:.3f}], from "
        f"{iv['residuals']} out-of-fold residuals of the total step energy "
        f"(median residual {record['residual_median']:+.3f}); {html.escape(iv['method'])}.</p>"
        "<table><tr><th>coverage, calibrating on half and testing "
        "on the other</th><th>mean</th><th>p05 &ndash; p95</th><th>repeats</th></tr>"
        f"{table}</table><p>{record['cells']} cells, {record['distinct_cell_splits']} distinct "
        "halvings of them.</p>"
        + (figure_html(png.name, "Out-of-fold metered/predicted step energy per "
                       "configuration, with the interval's bounds") if png else ""))


def _plot_residuals(residuals: Path, interval: dict[str, Any], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not residuals.is_file():
        return None
    steps = pd.read_parquet(residuals)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bins = np.histogram_bin_edges(1.0 + steps.residual, bins=40)  # one grid for all configs
    for config, g in steps.groupby("config"):
        ax.hist(1.0 + g.residual, bins=bins, alpha=0.6, label=f"{config} ({len(g)} steps)")
    for x, name in ((interval["lower"], "lower"), (interval["upper"], "upper")):
        ax.axvline(x, color="k", linestyle="--")
        ax.annotate(f"{name} {x:.3f}", (x, 1), xycoords=("data", "axes fraction"),
                    xytext=(3, -12), textcoords="offset points", fontsize=8)
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("metered / predicted total step energy (out of fold)")
    ax.set_ylabel("steps")
    ax.set_title(f"{interval['level']:.0%} split-conformal interval", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path
