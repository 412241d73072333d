"""Engine core: a step's warm-up energy (one-off work inside it, `warmup.py` judges its time)
taken out of its requests' shares and counted under outcome `warmup`. The first steps, run
before the rule can judge them, are judged once it can."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vllm_piep.once import logger
from vllm_piep.predict.stepgraph import N_OUT
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
    """Warm-up taken out of the shares (module docstring). A part of `EngineAccountant`
    (`accountant.py`), which sets up the state it uses."""

    warmup: WarmupDetector
    _suspects: list[Suspect]

    def _take_warmup(self, req_ids: list[str], tokens: float, increment: np.ndarray,
                     seconds: float) -> tuple[np.ndarray, float]:
        """The shares of a step of `tokens` without its warm-up energy, and that energy
        (counted apart). In measured mode the first steps are not judged afterwards (their
        energy may be settled and sent by then): only steps after the detector is ready."""
        detector = self.warmup
        if not detector.ready:
            detector.observe(tokens, seconds)
            if self.splitter is None:
                self._suspects.append(Suspect(tokens, seconds, list(req_ids),
                                              increment.copy()))
                if detector.ready:
                    self._judge_suspects()
            return increment, 0.0
        excess = detector.excess_s(tokens, seconds)
        detector.observe(tokens, seconds - excess)
        if excess <= 0.0:
            return increment, 0.0
        moved = warmup_part(increment, excess / seconds)
        self._say_warmup(excess, seconds)
        return increment - moved, float(moved[:, _STATIC].sum())

    def _judge_suspects(self) -> None:
        """The first steps, judged once the history allows: their warm-up energy leaves the
        rows of their requests that are still in flight."""
        suspects, self._suspects = self._suspects, []
        for suspect in suspects:
            excess = self.warmup.excess_s(suspect.tokens, suspect.seconds)
            if excess <= 0.0:
                continue
            moved = warmup_part(suspect.increment, excess / suspect.seconds)
            for req_id, part in zip(suspect.req_ids, moved, strict=True):
                slot = self.table.slots.get(req_id)
                if slot is not None and req_id not in self._gone:
                    self.table.rows[slot, :N_OUT] -= part
                    self.warmup_joules += float(part[_STATIC])
            self._say_warmup(excess, suspect.seconds)

    def _say_warmup(self, excess: float, seconds: float) -> None:
        if not self._warmup_said:
            self._warmup_said = True
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
