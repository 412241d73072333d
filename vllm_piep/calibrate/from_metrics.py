"""A correction of the analytic prior from what a server in measured mode learnt: its meter's
energy over the prior's, for the static and the dynamic parts (`piep_measured_ratio`), written
as a small JSON file that a server without a meter loads with `prior_correction`.

    python -m vllm_piep.calibrate from-metrics http://gpu-host:8000/metrics --out fit.json
    vllm serve MODEL --plugins piep --additional-config '{"piep": {"prior_correction": "fit.json"}}'

The correction fits the hardware and model it was measured on: the file names the bundle (the
prior's device profile) it corrects, and a server whose prior differs refuses it (one log line)
and serves the plain prior. The file records the server's meter and whether it measures: a
correction fitted to a CPU estimate or a simulator is written too (one warning line says so),
and a server serving it says `"source": "estimated"` (or `simulated`), not `calibrated`.
No vLLM imports; no pickles (JSON only).
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_fd_to_metric_families

from vllm_piep.meters.common import Source as MeterSource
from vllm_piep.predict.base import fit_warning
from vllm_piep.predict.correction import SCHEMA, PriorCorrection

# Least trustworthy last: a server whose energy is labelled with several kinds is taken as the
# last (the order `meters.common.CompositeMeter` ranks its parts by).
METER_SOURCES: tuple[MeterSource, ...] = get_args(MeterSource)


def read_metrics(source: str, timeout_s: float = 10.0) -> str:
    """The /metrics text of a URL, or of a file it was saved to."""
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=timeout_s) as response:
            return response.read().decode()
    return Path(source).read_text()


def metric_families(text: str, source: str) -> Iterator[Metric]:
    """The metric families of a /metrics text; a ValueError naming `source` and the line that
    is not Prometheus text (the parser reads line by line, so the last line read is at fault)."""
    lines = text.splitlines(keepends=True)
    at = 0

    def numbered() -> Iterator[str]:
        nonlocal at
        for at, line in enumerate(lines, 1):  # `at`: the line being parsed
            yield line

    try:
        yield from text_fd_to_metric_families(numbered())  # type: ignore[arg-type]
    except ValueError as exc:
        where = f"line {at}: {lines[at - 1].strip()[:80]!r}" if at else "no line"
        raise ValueError(f"{source}: not a Prometheus text exposition ({where}"
                         + (f": {exc})" if str(exc) else ")")) from None


def correction_from_metrics(text: str, source: str) -> PriorCorrection:
    """ValueError when the text holds no measured-mode figures of a prior."""
    ratios: dict[str, dict[str, float]] = {}
    totals: dict[str, float] = {}
    bundles: set[str] = set()
    meters: set[str] = set()
    kinds: set[MeterSource] = set()
    for family in metric_families(text, source):
        for sample in family.samples:
            if sample.name == "piep_engine_measured" and sample.value > 0:
                meters.add(sample.labels.get("meter", ""))
            elif (sample.name == "piep_energy_joules_total" and sample.value > 0
                  and sample.labels.get("source") in METER_SOURCES):
                kinds.add(sample.labels["source"])  # type: ignore[arg-type]
            elif sample.name == "piep_measured_ratio":
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
    meter, meter_source = measured_with(meters, kinds, source)
    return PriorCorrection(
        schema=SCHEMA, static_ratio=statistics.fmean(r["static"] for r in usable),
        dynamic_ratio=statistics.fmean(r["dynamic"] for r in usable), bundle=prior[0],
        measured_joules=totals.get("piep_engine_step_joules_total", 0.0),
        predicted_joules=predicted, engines=len(usable), source=source,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), meter=meter,
        meter_source=meter_source)


def measured_with(names: set[str], kinds: set[MeterSource], source: str
                  ) -> tuple[str, MeterSource]:
    """The meter a measured server measured with (`names`: `piep_engine_measured{meter}` of its
    engines in measured mode) and its kind (`kinds`: the meter sources its energy is counted
    under in `piep_energy_joules_total{source}`: measured, estimated or simulated; the least
    trustworthy wins). ValueError where /metrics do not say them."""
    names = names - {""}
    if not names:
        raise ValueError(f"{source}: piep_engine_measured names no meter in measured mode: "
                         "which meter measured the server cannot be told")
    if not kinds:
        raise ValueError(f"{source}: piep_energy_joules_total has no energy labelled measured, "
                         "estimated or simulated: whether the meter measures cannot be told")
    return ",".join(sorted(names)), max(kinds, key=METER_SOURCES.index)


def estimate_warning(fit: PriorCorrection) -> str | None:
    """The one line `from-metrics` prints for a correction fitted to a meter that estimates or
    simulates; None for one that measures (or a file that records no meter)."""
    if fit.meter is None or fit.meter_source is None:
        return None
    return fit_warning("the correction", fit.meter, fit.meter_source)
