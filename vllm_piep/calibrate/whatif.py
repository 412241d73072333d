"""What-if: predicted energy per output token against time per output token across tensor-
parallel degrees and batch sizes, from a campaign bundle (PIE-P §5.2, Fig. 3).

For each (TP, batch) a decode step of `batch` requests at context `context` is predicted: its
time by the bundle's step-time model, its energy by the bundle (leaves + static power over that
time). Every request gets one token per step, so time per output token is the step time and
energy per output token the step's energy over the batch. A degree the campaign did not
measure is predicted from the nearest measured configuration's tree, waits and idle power;
the output marks it (`measured_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from vllm_piep.model.flops import ModelShape, StepBatch, StepTotals
from vllm_piep.predict.base import StepInput
from vllm_piep.predict.bundle import TreeBundle, _session
from vllm_piep.predict.served import BundlePredictor, Serving, step_nodes


def whatif_table(bundle_dir: str | Path, tps: Sequence[int], batches: Sequence[int],
                 context: int, pp: int = 1) -> pd.DataFrame:
    bundle = TreeBundle.load(bundle_dir)
    serving = Serving.of(bundle.manifest)
    timing = bundle.manifest["serving"]["step_time"]
    timer = _session(Path(bundle_dir) / timing["file"])
    base = ModelShape(**bundle.manifest["serving"]["shape"])
    rows = []
    for tp in tps:
        shape = dataclasses.replace(base, tp=int(tp), pp=int(pp))
        predictor = BundlePredictor(bundle, shape)
        for batch in batches:
            step = StepBatch.from_rows([(0, 1, context, 1)] * int(batch))
            nodes = step_nodes(predictor.template, shape, StepTotals.of(step), float(batch),
                               predictor.wait_s)
            root = nodes[nodes.parent_id == ""][timing["features"]].to_numpy(np.float64)
            seconds = float(np.asarray(timer.run(None, {"X": root})[0]).reshape(-1)[0])
            joules = predictor.predict_step(StepInput(step, max(seconds, 0.0))).joules
            rows.append({"tp": int(tp), "pp": int(pp), "batch": int(batch),
                         "measured_config": predictor.template_config,
                         "step_s": seconds, "time_per_token_s": seconds,
                         "tokens_per_s": batch / seconds if seconds > 0 else np.nan,
                         "joules_per_token": float(joules.sum()) / batch,
                         "static_share": float(joules[-1] / joules.sum())})
    out = pd.DataFrame(rows)
    out.attrs["meter"] = serving.meter
    out.attrs["bundle_id"] = bundle.bundle_id
    return out


def plot_whatif(table: pd.DataFrame, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for tp, g in table.groupby("tp"):
        g = g.sort_values("batch")
        measured = g.measured_config.iloc[0].startswith(f"tp{tp}-")
        ax.plot(g.time_per_token_s * 1e3, g.joules_per_token, marker="o",
                linestyle="-" if measured else "--",
                label=f"TP {tp}" + ("" if measured else f" (from {g.measured_config.iloc[0]})"))
        for r in g.itertuples():
            ax.annotate(f"b{r.batch}", (r.time_per_token_s * 1e3, r.joules_per_token),
                        textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("time per output token (ms)")
    ax.set_ylabel("energy per output token (J)")
    ax.set_title(f"what-if: {table.attrs.get('bundle_id', '')}\n"
                 f"meter: {table.attrs.get('meter', '')}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
