"""Engine core: a step's warm-up energy (one-off work inside it, `warmup.py` judges its time)
taken out of its requests' shares and counted under outcome `warmup`. The first steps, run
before the rule can judge them, are judged once it can."""

from __future__ import annotations

from collections.abc import Container
from typing import NamedTuple

import numpy as np

from vllm_piep.once import logger
from vllm_piep.runtime.engine_core.request_table import RequestTable
from vllm_piep.runtime.engine_core.warmup import WarmupDetector
from vllm_piep.runtime.record import COLUMN

_PREFILL, _DECODE, _STATIC = COLUMN["prefill"], COLUMN["decode"], COLUMN["static"]


class Suspect(NamedTuple):
    """A step run before the warm-up rule could judge it (`warmup.py`)."""

    tokens: float
    seconds: float
    req_ids: list[str]
    increment: np.ndarray  # its [N, N_OUT] shares, as added to the requests' rows


class WarmupShares:
    """Warm-up taken out of the steps' shares (module docstring): the detector, and the first
    steps waiting to be judged."""

    def __init__(self, table: RequestTable) -> None:
        self.table = table
        self.detector = WarmupDetector()
        self.suspects: list[Suspect] = []
        self._said = False

    @property
    def ready(self) -> bool:
        return self.detector.ready

    def fraction(self, tokens: float, seconds: float) -> float:
        """Once the detector is ready: the fraction of a step of `tokens` that was warm-up (its
        static energy's share to take out), learning from the step."""
        detector = self.detector
        excess = detector.excess_s(tokens, seconds)
        detector.observe(tokens, seconds - excess)
        if excess <= 0.0:
            return 0.0
        self._say(excess, seconds)
        return excess / seconds

    def take(self, req_ids: list[str], tokens: float, increment: np.ndarray, seconds: float,
             gone: Container[str], judge_later: bool = True) -> tuple[np.ndarray, float]:
        """The shares of a step of `tokens` without its warm-up energy, and that energy
        (counted apart). Before the detector is ready the step is kept to be judged once it
        is (`judge_later`; measured mode does not: the first steps' energy may be settled and
        sent by then); released requests (`gone`) keep their share then."""
        detector = self.detector
        if not detector.ready:
            detector.observe(tokens, seconds)
            if judge_later:
                self.suspects.append(Suspect(tokens, seconds, list(req_ids), increment.copy()))
                if detector.ready:
                    self._judge_suspects(gone)
            return increment, 0.0
        fraction = self.fraction(tokens, seconds)
        if fraction <= 0.0:
            return increment, 0.0
        moved = warmup_part(increment, fraction)
        return increment - moved, float(moved[:, _STATIC].sum())

    def _judge_suspects(self, gone: Container[str]) -> None:
        """The first steps, judged once the history allows: their warm-up energy leaves the
        rows of their requests that are still in flight."""
        suspects, self.suspects = self.suspects, []
        table = self.table
        for suspect in suspects:
            excess = self.detector.excess_s(suspect.tokens, suspect.seconds)
            if excess <= 0.0:
                continue
            moved = warmup_part(suspect.increment, excess / suspect.seconds)
            for req_id, part in zip(suspect.req_ids, moved, strict=True):
                slot = table.slots.get(req_id)
                if slot is not None and req_id not in gone:
                    table.add(np.array([slot]), -part[None, :])
                    table.outcomes.warmup += float(part[_STATIC])
            self._say(excess, suspect.seconds)

    def _say(self, excess: float, seconds: float) -> None:
        if not self._said:
            self._said = True
            logger.info("vllm_piep: a %.2f s step held %.2f s of one-off work (warm-up); its "
                        "static energy is counted under outcome `warmup`, not billed to the "
                        "step's requests", seconds, excess)


def warmup_part(increment: np.ndarray, fraction: float) -> np.ndarray:
    """The part of a step's shares that its warm-up time explains: that fraction of each
    request's static energy, taken from its prefill and decode columns in their proportion."""
    part = np.zeros_like(increment)
    static = increment[:, _STATIC] * fraction
    part[:, _STATIC] = static
    phases = increment[:, _PREFILL] + increment[:, _DECODE]
    share = np.divide(increment[:, _PREFILL], phases, out=np.zeros_like(phases),
                      where=phases > 0)
    part[:, _PREFILL] = static * share
    part[:, _DECODE] = static - part[:, _PREFILL]
    return part
