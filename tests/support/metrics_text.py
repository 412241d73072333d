"""Read Prometheus text exposition into {(name, labels): value}."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """{value of `label`: sample} for every sample of `name` that has that label."""
    out: dict[str, float] = {}
    for (sample, labels), v in samples(text).items():
        found = dict(labels).get(label)
        if sample == name and found is not None:
            out[found] = out.get(found, 0.0) + v
    return out


def total(text: str, name: str, **labels: str) -> float:
    """`name` summed over all its label sets that have these `labels` (0 when none does)."""
    want = labels.items()
    return math.fsum(v for (sample, found), v in samples(text).items()
                     if sample == name and want <= set(found))
