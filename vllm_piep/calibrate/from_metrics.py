"""A correction of the analytic prior from what a server in measured mode learnt: its meter's
energy over the prior's, for the static and the dynamic parts (`piep_measured_ratio`), written
as a small JSON file that a server without a meter loads with `prior_correction`.

    python -m vllm_piep.calibrate from-metrics http://gpu-host:8000/metrics --out fit.json
    vllm serve MODEL --plugins piep --additional-config '{"piep": {"prior_correction": "fit.json"}}'

The correction fits the hardware and model it was measured on: the file names the bundle (the
prior's device profile) it corrects, and a server whose prior differs refuses it (one log line)
and serves the plain prior. No vLLM imports; no pickles (JSON only).
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from vllm_piep.predict.correction import SCHEMA, PriorCorrection


def read_metrics(source: str, timeout_s: float = 10.0) -> str:
    """The /metrics text of a URL, or of a file it was saved to."""
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=timeout_s) as response:
            return response.read().decode()
    return Path(source).read_text()


def correction_from_metrics(text: str, source: str) -> PriorCorrection:
    """ValueError when the text holds no measured-mode figures of a prior."""
    ratios: dict[str, dict[str, float]] = {}
    totals: dict[str, float] = {}
    bundles: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "piep_measured_ratio":
                ratios.setdefault(sample.labels.get("engine", "0"), {})[
                    sample.labels.get("group", "")] = sample.value
                bundles.add(sample.labels.get("bundle", ""))
            elif sample.name in ("piep_engine_step_joules_total",
                                 "piep_engine_predicted_joules_total"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    usable = [r for r in ratios.values()
              if all(math.isfinite(r.get(g, math.nan)) and r.get(g, 0) > 0
                     for g in ("static", "dynamic"))]
    if not usable:
        raise ValueError(f"{source}: no piep_measured_ratio: the server did not run in measured "
                         "mode (no meter measured it), or has served nothing yet")
    predicted = totals.get("piep_engine_predicted_joules_total", 0.0)
    if predicted <= 0:
        raise ValueError(f"{source}: piep_engine_predicted_joules_total is 0: nothing was "
                         "measured to fit")
    prior = [b for b in bundles if b.startswith("prior/")]
    if len(prior) != 1:
        raise ValueError(f"{source}: the server's predictor is not one analytic prior "
                         f"(bundles seen: {sorted(bundles) or 'none'}); only the prior can be "
                         "corrected this way")
    return PriorCorrection(
        schema=SCHEMA, static_ratio=statistics.fmean(r["static"] for r in usable),
        dynamic_ratio=statistics.fmean(r["dynamic"] for r in usable), bundle=prior[0],
        measured_joules=totals.get("piep_engine_step_joules_total", 0.0),
        predicted_joules=predicted, engines=len(usable), source=source,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
