"""The calibrate CLI's input errors and choices, apart from the modules that raise them so that
the CLI's parser and `--help` import no scikit-learn, SciPy or tqdm."""

from __future__ import annotations

PROTOCOLS = ("leave-one-model-out", "leave-one-batch-out", "leave-one-tp-out", "kfold")


class ProtocolError(ValueError):
    """A protocol the dataset cannot support (one group only, a missing column)."""


class FitError(ValueError):
    """Too few configurations to fit."""
