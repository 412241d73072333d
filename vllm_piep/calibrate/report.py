"""The evaluation report: a few PNG plots and one self-contained HTML page.

The evaluation JSON (`result`) carries the headline numbers; the long `predictions` table
(one row per node per method) carries what the numbers hide: the spread of errors, which the
scatter plots, the error CDF and the per-model error bars show.  The page has no JS and no
external CSS so that it can be opened from a CI artifact or attached to a mail as is.
"""

from __future__ import annotations

import html
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from vllm_piep.datasets.model import LEVELS

"""Finest to coarsest: the order of table columns, and which level is "highest"."""

MAX_SCATTER_POINTS = 20_000
"""More points only cost time: at that density the scatter is a cloud either way."""

MAX_CDF_POINTS = 2_000
"""A CDF drawn through 2k quantiles is indistinguishable from one through every node."""

DASH = "–"


# ----------------------------------------------------------------------------------------------
# reading the result


def _ordered_levels(names: Iterable[str]) -> list[str]:
    """Known levels in their natural order first, then unknown ones alphabetically, so that
    tables and plots read finest to coarsest whatever the dataset."""
    names = set(names)
    known = [lv for lv in LEVELS if lv in names]
    return known + sorted(names - set(known))


def _methods(result: dict) -> list[str]:
    """The main method first (it is what the report is about), then baselines as given."""
    return [str(result.get("method", "main"))] + list(result.get("baselines", {}) or {})


def _method_block(result: dict, method: str) -> dict:
    """`levels`/`per_model` of one method: the top level of `result` for the main method."""
    if method == _methods(result)[0]:
        return result
    return (result.get("baselines") or {}).get(method) or {}


def _level_mape(result: dict, method: str, level: str) -> float | None:
    entry = (_method_block(result, method).get("levels") or {}).get(level)
    return _number(entry.get("mape")) if isinstance(entry, dict) else None


def _model_mape(result: dict, method: str, model: str, level: str) -> float | None:
    per_model = _method_block(result, method).get("per_model") or {}
    return _number((per_model.get(model) or {}).get(level))


def _number(value: Any) -> float | None:
    """A finite float or None: missing or broken values are shown as a dash, not as 'nan'."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _all_levels(result: dict) -> list[str]:
    names: set[str] = set(result.get("levels") or {})
    for block in (result.get("baselines") or {}).values():
        names |= set((block or {}).get("levels") or {})
    return _ordered_levels(names)


def _summary_level(levels: list[str]) -> str:
    """Model level if present (the figure papers compare), else the coarsest level there is."""
    return "model" if "model" in levels else levels[-1]


def _models(result: dict, predictions: pd.DataFrame) -> list[str]:
    """Models in the order of the result, then any only seen in the predictions."""
    names = [str(m) for m in result.get("per_model") or {}]
    if "model" in predictions:
        seen = set(names)
        names += sorted({str(m) for m in predictions["model"].unique()} - seen)
    return names


def _fmt(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}"


# ----------------------------------------------------------------------------------------------
# errors from the predictions


def _with_ape(predictions: pd.DataFrame) -> pd.DataFrame:
    """Rows with a usable measurement plus their absolute percentage error.  Zero or negative
    measurements have no percentage error (and no place on a log axis), so they are dropped."""
    cols = ["model", "level", "method", "measured_j", "predicted_j"]
    df = predictions[cols + (["type"] if "type" in predictions else [])].copy()
    df["model"] = df["model"].astype(str)
    df["measured_j"] = pd.to_numeric(df["measured_j"], errors="coerce")
    df["predicted_j"] = pd.to_numeric(df["predicted_j"], errors="coerce")
    df = df[(df["measured_j"] > 0) & np.isfinite(df["predicted_j"])]
    df["ape"] = (df["predicted_j"] - df["measured_j"]).abs() / df["measured_j"] * 100.0
    return df


def _standard_errors(df: pd.DataFrame, level: str) -> dict[tuple[str, str], float]:
    """Standard error of the per-node percentage errors per (method, model): the bar's
    uncertainty if the nodes were a sample of what the model would see."""
    sub = df[df["level"] == level]
    stats = sub.groupby(["method", "model"])["ape"].agg(["std", "count"])
    out: dict[tuple[str, str], float] = {}
    for (method, model), row in stats.iterrows():
        if row["count"] > 1 and math.isfinite(row["std"]):
            out[(str(method), str(model))] = float(row["std"]) / math.sqrt(row["count"])
    return out


# ----------------------------------------------------------------------------------------------
# plots


def _mpl_text(text: str) -> str:
    """Text for matplotlib: a pair of '$' in a model name would otherwise be parsed as math."""
    return text.replace("$", r"\$")


def _save(fig: Any, path: Path) -> None:
    """Write next to the target and rename, so a reader never sees half a PNG."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=150, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def _safe_name(level: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", level) or "level"


SPREAD_FOR_LOG = 30.0
"""Values whose largest is this many times their smallest go on a log axis: on a linear one
a baseline at 1500 % squashes every other bar to the floor."""


def _spans_decades(values: Iterable[float]) -> bool:
    """Whether the positive finite values are spread widely enough for a log axis."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    return len(v) > 1 and float(v.max()) >= SPREAD_FOR_LOG * float(v.min())


def _log_note(log: bool) -> str:
    """What a caption adds when its plot's axis is logarithmic."""
    return " (log scale: the values span decades)" if log else ""


def _model_colors(models: list[str]) -> dict[str, Any]:
    """tab10 while it suffices (its colours are the easiest to tell apart), tab20 beyond.
    Also used for methods."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10" if len(models) <= 10 else "tab20")
    return {m: cmap(i % cmap.N) for i, m in enumerate(models)}


def _plot_scatter(df: pd.DataFrame, method: str, level: str, mape: float | None,
                  models: list[str], path: Path) -> None:
    """Predicted vs metered on log axes: multiplicative errors look the same at every scale,
    and a systematic bias of one model shows as its own colour off the diagonal."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    sub = df[(df["method"] == method) & (df["level"] == level) & (df["predicted_j"] > 0)]
    sub = sub.sample(min(len(sub), MAX_SCATTER_POINTS), random_state=0)
    fig, ax = plt.subplots(figsize=(6, 5.5))
    colors = _model_colors(models)
    # One call, in sampled (random) order: drawn model by model, the last would hide the rest.
    ax.scatter(sub["measured_j"], sub["predicted_j"], s=6, alpha=0.5, linewidths=0,
               c=[colors[m] for m in sub["model"]], rasterized=True)
    handles = [Line2D([], [], ls="", marker="o", color=colors[m], label=_mpl_text(m))
               for m in models if m in set(sub["model"])]
    if len(sub):
        lo = float(min(sub["measured_j"].min(), sub["predicted_j"].min()))
        hi = float(max(sub["measured_j"].max(), sub["predicted_j"].max()))
        handles += ax.plot([lo, hi], [lo, hi], color="black", lw=1, ls="--", label="y = x")
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("metered energy (J)")
    ax.set_ylabel("predicted energy (J)")
    ax.set_title(_mpl_text(f"{method}, {level} level: MAPE {_fmt(mape)}%"))
    if len(models) <= 20 and len(sub):
        ax.legend(handles=handles, fontsize=7, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)
    _save(fig, path)


def _cdf_points(ape: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(error, fraction <= error), thinned to quantiles so 25k nodes draw as fast as 2k."""
    ape = np.sort(ape)
    frac = np.arange(1, len(ape) + 1) / len(ape)
    if len(ape) > MAX_CDF_POINTS:
        idx = np.unique(np.linspace(0, len(ape) - 1, MAX_CDF_POINTS).astype(int))
        ape, frac = ape[idx], frac[idx]
    return ape, frac


def _plot_error_cdf(df: pd.DataFrame, methods: list[str], level: str, path: Path) -> bool:
    """CDF of absolute percentage errors (IrEne Fig. 3): the mean hides the tail, this does
    not.  Linear, the x range follows the main method's 99th percentile so baselines that are
    far off do not squash the curve that matters; when the methods' errors span decades the
    axis is logarithmic instead and shows them all. Returns whether it is."""
    import matplotlib.pyplot as plt

    sub = df[df["level"] == level]
    colors = _model_colors(methods)  # one distinct colour per method, beyond ten too
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    x_max = 0.0
    apes = {m: sub.loc[sub["method"] == m, "ape"].to_numpy() for m in methods}
    medians = [float(np.median(a)) for a in apes.values() if len(a)]
    log = _spans_decades(medians)
    for i, method in enumerate(methods):
        ape = apes[method]
        if not len(ape):
            continue
        xs, ys = _cdf_points(ape)
        main = i == 0
        ax.plot(xs, ys, lw=2.6 if main else 1.2, label=_mpl_text(method), zorder=3 if main else 2,
                color="black" if main else colors[method])
        if main:
            p99 = float(np.percentile(ape, 99))
            ax.plot([p99], [0.99], marker="o", color="red", zorder=4,
                    label=f"p99 {_mpl_text(method)}: {p99:.2f}%")
            x_max = max(x_max, 1.5 * p99)
        else:
            x_max = max(x_max, float(np.percentile(ape, 90)))
    if log:
        positive = np.concatenate([a[a > 0] for a in apes.values()])
        ax.set_xscale("log")
        ax.set_xlim(float(np.percentile(positive, 1)), 1.5 * float(positive.max()))
    else:
        ax.set_xlim(0, x_max if x_max > 0 else 1.0)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("absolute percentage error (%)" + (", log scale" if log else ""))
    ax.set_ylabel("fraction of predictions")
    ax.set_title(_mpl_text(f"Error CDF, {level} level"))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)
    return log


def _plot_per_model(result: dict, df: pd.DataFrame, methods: list[str], models: list[str],
                    level: str, path: Path) -> bool:
    """Grouped bars per held-out model (PIE-P Fig. 2): whether one method wins on every model
    or only on average.  Heights are the result's numbers; error bars come from the nodes.
    Returns whether the axis is logarithmic."""
    import matplotlib.pyplot as plt

    errors = _standard_errors(df, level)
    bar_slots = len(models) * max(1, len(methods))
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 1.0 + 0.12 * bar_slots)), 4.5))
    width = 0.8 / max(1, len(methods))
    colors = _model_colors(methods)
    x = np.arange(len(models))
    log = _spans_decades(_model_mape(result, method, m, level) for method in methods
                         for m in models)
    for j, method in enumerate(methods):
        heights = [_model_mape(result, method, m, level) for m in models]
        h = np.array([np.nan if v is None else v for v in heights], dtype=float)
        err = np.array([errors.get((method, m), np.nan) for m in models], dtype=float)
        # A percentage error is never negative: clip the lower whisker at zero.
        err = np.vstack([np.minimum(err, np.nan_to_num(h)), err])
        main = j == 0
        pos = x + (j - (len(methods) - 1) / 2) * width
        ax.bar(pos, h, width, label=_mpl_text(method), edgecolor="black" if main else "none",
               linewidth=1.2 if main else 0, color=colors[method])
        # Separately: bar(yerr=...) trips a NumPy deprecation inside matplotlib for one model.
        ax.errorbar(pos, h, yerr=err, fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
    ax.set_xticks(x)
    ax.set_xticklabels([_mpl_text(m) for m in models], rotation=30, ha="right", fontsize=8)
    if log:
        ax.set_yscale("log", nonpositive="clip")
    ax.set_ylabel(f"MAPE at {level} level (%)" + (", log scale" if log else ""))
    ax.set_title(_mpl_text(f"Per held-out model, {level} level"))
    ax.grid(True, axis="y", which="both" if log else "major", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return log


def _plot_residuals(df: pd.DataFrame, method: str, levels: list[str], models: list[str],
                    path: Path) -> None:
    """Predicted over metered against metered, one panel per level, both axes logarithmic:
    a bias shows as a model's points off the line at 1, a scale dependence as a slope. The
    legend gives each model's median ratio."""
    import matplotlib.pyplot as plt

    sub = df[(df["method"] == method) & (df["predicted_j"] > 0)]
    fig, axes = plt.subplots(1, len(levels), figsize=(4.2 * len(levels) + 1, 4.2), sharey=True,
                             squeeze=False)
    colors = _model_colors(models)
    for ax, level in zip(axes[0], levels):
        at = sub[sub["level"] == level]
        at = at.sample(min(len(at), MAX_SCATTER_POINTS), random_state=0)
        ratio = at["predicted_j"] / at["measured_j"]
        for model in models:
            mine = at["model"] == model
            if mine.any():
                ax.scatter(at.loc[mine, "measured_j"], ratio[mine], s=6, alpha=0.5,
                           linewidths=0, color=colors[model], rasterized=True,
                           label=_mpl_text(f"{model} (median {ratio[mine].median():.3g})"))
        for y, style in ((1.0, "--"), (1.1, ":"), (1 / 1.1, ":")):
            ax.axhline(y, color="black", lw=1 if y == 1.0 else 0.7, ls=style)
        if len(at):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.legend(fontsize=6, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("metered energy (J)")
        ax.set_title(_mpl_text(f"{level} level"))
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel("predicted / metered (dotted: ±10 %)")
    fig.suptitle(_mpl_text(f"Residuals of {method}"))
    _save(fig, path)


def _plot_per_type(df: pd.DataFrame, methods: list[str], path: Path) -> bool | None:
    """Mean absolute percentage error by node type (attention, MLP, norm, Linear...) and
    method, over every level but the whole model: which part of the tree the error comes from.
    None (nothing written) without types; else whether the axis is logarithmic."""
    import matplotlib.pyplot as plt

    if "type" not in df:
        return None
    sub = df[(df["level"] != "model") & df["type"].notna()]
    if sub.empty:
        return None
    table = sub.groupby(["type", "method"])["ape"].mean().unstack("method")
    counts = sub[sub["method"] == methods[0]].groupby("type").size()
    types = list(table.index)
    colors = _model_colors(methods)
    shown = [m for m in methods if m in table.columns]
    width = 0.8 / max(1, len(shown))
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 1.0 + 0.35 * len(types) * len(shown))),
                                    4.5))
    x = np.arange(len(types))
    for j, method in enumerate(shown):
        ax.bar(x + (j - (len(shown) - 1) / 2) * width, table[method].to_numpy(), width,
               label=_mpl_text(method), color=colors[method],
               edgecolor="black" if j == 0 else "none", linewidth=1.2 if j == 0 else 0)
    log = _spans_decades(table.to_numpy().ravel())
    if log:
        ax.set_yscale("log", nonpositive="clip")
    ax.set_xticks(x)
    ax.set_xticklabels([_mpl_text(f"{t}\n(n={int(counts.get(t, 0))})") for t in types],
                       rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("MAPE over nodes (%)" + (", log scale" if log else ""))
    ax.set_title("Error by node type (all levels below the model)")
    ax.grid(True, axis="y", which="both" if log else "major", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return log


# ----------------------------------------------------------------------------------------------
# HTML

PAGE_CSS = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.7em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
tr.targets td { font-style: italic; color: #555; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #ddd; }
figcaption { color: #444; max-width: 1100px; }
"""
"""The report pages' style sheet (the evaluation's and the campaign's)."""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def figure_html(name: str, caption: str) -> str:
    """A plot at full width, linked to its file, with a caption saying what it shows."""
    return (f'<figure><a href="{_e(name)}"><img src="{_e(name)}" alt="{_e(caption)}"></a>'
            f'<figcaption>{_e(caption)}</figcaption></figure>')


def _levels_table(result: dict, methods: list[str], levels: list[str]) -> str:
    """Methods × levels, best (lowest) MAPE of each column in bold."""
    values = {m: [_level_mape(result, m, lv) for lv in levels] for m in methods}
    best = []
    for k in range(len(levels)):
        column = [v[k] for v in values.values() if v[k] is not None]
        best.append(min(column) if column else None)
    main_levels = result.get("levels") or {}
    head = "".join(
        f"<th>{_e(lv)}"
        + (f"<br><small>n={_e(main_levels[lv]['n'])}</small>"
           if isinstance(main_levels.get(lv), dict) and "n" in main_levels[lv] else "")
        + "</th>" for lv in levels)
    rows = [f"<tr><th>method</th>{head}</tr>"]
    for m in methods:
        cells = []
        for k, v in enumerate(values[m]):
            text = _e(_fmt(v))
            cells.append(f"<td><b>{text}</b></td>" if v is not None and v == best[k]
                         else f"<td>{text}</td>")
        rows.append(f"<tr><td>{_e(m)}</td>{''.join(cells)}</tr>")
    node_means = [_number((main_levels.get(lv) or {}).get("mape_nodes")) for lv in levels]
    if any(v is not None for v in node_means):
        cells = "".join(f"<td>{_e(_fmt(v))}</td>" for v in node_means)
        rows.append(f"<tr class='targets'><td>{_e(methods[0])} (mean over nodes)</td>{cells}</tr>")
    targets = result.get("targets") or {}
    if targets:
        cells = "".join(f"<td>{_e(_fmt(_number(targets.get(lv))))}</td>" for lv in levels)
        rows.append(f"<tr class='targets'><td>target</td>{cells}</tr>")
    return "<table>\n" + "\n".join(rows) + "\n</table>"


def _per_model_table(result: dict, method: str, models: list[str], levels: list[str]) -> str:
    rows = ["<tr><th>model</th>" + "".join(f"<th>{_e(lv)}</th>" for lv in levels) + "</tr>"]
    for model in models:
        cells = "".join(f"<td>{_e(_fmt(_model_mape(result, method, model, lv)))}</td>"
                        for lv in levels)
        rows.append(f"<tr><td>{_e(model)}</td>{cells}</tr>")
    return "<table>\n" + "\n".join(rows) + "\n</table>"


def _header(result: dict) -> str:
    bad = result.get("bad_rows")
    if isinstance(bad, list):  # the JSON lists every one; the page shows how many and one
        bad = f"{len(bad)}" + (f" (all in the JSON), e.g. {bad[0]}" if bad else "")
    facts = [("dataset", result.get("dataset")), ("protocol", result.get("protocol")),
             ("method", result.get("method")),
             ("what it is", result.get("description")),
             ("ground truth", result.get("ground_truth")), ("trees", result.get("n_trees")),
             ("bad rows skipped", bad)]
    items = "".join(f"<li>{_e(k)}: {_e(v)}</li>" for k, v in facts if v is not None)
    described = [(name, b.get("description")) for name, b in
                 (result.get("baselines") or {}).items() if b.get("description")]
    if described:
        items += "<li>compared with:<ul>" + "".join(
            f"<li>{_e(n)}: {_e(d)}</li>" for n, d in described) + "</ul></li>"
    title = f"Energy prediction: {result.get('dataset', '?')}, {result.get('protocol', '?')}"
    return f"<h1>{_e(title)}</h1>\n<ul>{items}</ul>"


def _html(result: dict, methods: list[str], models: list[str], levels: list[str],
          images: list[tuple[str, str]]) -> str:
    notes = [str(n) for n in result.get("notes") or []]
    notes_html = ("<h2>Notes</h2>\n<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>"
                  if notes else "")
    imgs = "\n".join(figure_html(name, caption) for name, caption in images)
    title = f"{result.get('dataset', '?')} — {result.get('method', '?')}"
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{_e(title)}</title><style>{PAGE_CSS}</style></head><body>\n"
        f"{_header(result)}\n"
        "<h2>MAPE (%) by level</h2>\n"
        f"{_levels_table(result, methods, levels)}\n"
        f"<h2>MAPE (%) per held-out model: {_e(methods[0])}</h2>\n"
        f"{_per_model_table(result, methods[0], models, levels)}\n"
        f"{notes_html}\n<h2>Plots</h2>\n{imgs}\n</body></html>\n"
    )


# ----------------------------------------------------------------------------------------------
# entry point


def write_report(result: dict, predictions: pd.DataFrame, out_dir: str | Path) -> Path:
    """Write the plots and `index.html` into `out_dir`; return the path of `index.html`."""
    import matplotlib

    matplotlib.use("Agg")  # here, not at import: importing the module must not change a backend

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    methods = _methods(result)
    levels = _all_levels(result) or _ordered_levels(predictions.get("level", pd.Series()).unique())
    if not levels:
        raise ValueError("result has no levels to report")
    models = _models(result, predictions)
    df = _with_ape(predictions)

    main = methods[0]
    images: list[tuple[str, str]] = []
    plotted = _ordered_levels(result.get("levels") or {}) or levels
    for level in plotted:
        name = f"scatter_{_safe_name(level)}.png"
        _plot_scatter(df, main, level, _level_mape(result, main, level), models, out / name)
        images.append((name, f"{main}: predicted against metered energy per node, {level} "
                             "level, log-log, one colour per model"))
    _plot_residuals(df, main, plotted, models, out / "residuals.png")
    images.append(("residuals.png", f"{main}: predicted/metered against metered, per level "
                                    "(log-log); the legend gives each model's median ratio"))
    summary = _summary_level(levels)
    log = _plot_error_cdf(df, methods, summary, out / "error_cdf.png")
    images.append(("error_cdf.png", f"Cumulative distribution of absolute percentage errors, "
                                    f"{summary} level, every method"
                                    + _log_note(log)))
    log = _plot_per_model(result, df, methods, models, summary, out / "per_model.png")
    images.append(("per_model.png", f"MAPE per held-out model, {summary} level"
                                    + _log_note(log)))
    log = _plot_per_type(df, methods, out / "per_type.png")
    if log is not None:
        images.append(("per_type.png", "MAPE by node type, every level below the whole model"
                                       + _log_note(log)))

    index = out / "index.html"
    tmp = out / ".index.html.tmp"
    tmp.write_text(_html(result, methods, models, levels, images), encoding="utf-8")
    os.replace(tmp, index)
    return index
