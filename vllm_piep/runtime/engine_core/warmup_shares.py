"""Engine core: a step's warm-up energy (one-off work inside it, `warmup.py` judges its time)
taken out of its requests' shares and counted under outcome `warmup`. The first steps, run
before the rule can judge them, are judged once it can."""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import NamedTuple

from vllm_piep.model.components import STATIC
from vllm_piep.once import logger
from vllm_piep.runtime.engine_core.request_table import FIRST, RequestTable
from vllm_piep.runtime.engine_core.warmup import WarmupDetector

_STATIC_COLUMN = FIRST + STATIC


class Suspect(NamedTuple):
    """A step run before the warm-up rule could judge it (`warmup.py`)."""

    tokens: float
    seconds: float
    req_ids: list[str]
    shares: list[tuple[float, ...]]  # its shares, as added to the requests' rows
    columns: tuple[int, ...]  # the row columns of the shares' values


class WarmupShares:
    """Warm-up taken out of the steps' shares (module docstring): the detector, and the first
    steps waiting to be judged."""

    def __init__(self, table: RequestTable) -> None:
        self.table = table
        self.detector = WarmupDetector()
        self.suspects: list[Suspect] = []
        self._said = False

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

    def take(self, req_ids: list[str], tokens: float, shares: list[tuple[float, ...]],
             columns: tuple[int, ...], seconds: float, gone: Container[str],
             judge_later: bool = True) -> tuple[list[tuple[float, ...]], float]:
        """The shares of a step of `tokens` without its warm-up energy, and that energy
        (counted apart). Before the detector is ready the step is kept to be judged once it
        is (`judge_later`; measured mode does not: the first steps' energy may be settled and
        sent by then); released requests (`gone`) keep their share then."""
        detector = self.detector
        if not detector.ready:
            detector.observe(tokens, seconds)
            if judge_later:
                self.suspects.append(Suspect(tokens, seconds, list(req_ids), list(shares),
                                             columns))
                if detector.ready:
                    self._judge_suspects(gone)
            return shares, 0.0
        fraction = self.fraction(tokens, seconds)
        if fraction <= 0.0:
            return shares, 0.0
        at = columns.index(_STATIC_COLUMN)
        kept, moved = [], 0.0
        for share in shares:
            part = warmup_part(share, at, fraction)
            kept.append(tuple(x - y for x, y in zip(share, part, strict=True)))
            moved += part[at]
        return kept, moved

    def _judge_suspects(self, gone: Container[str]) -> None:
        """The first steps, judged once the history allows: their warm-up energy leaves the
        rows of their requests that are still in flight."""
        suspects, self.suspects = self.suspects, []
        table = self.table
        for suspect in suspects:
            excess = self.detector.excess_s(suspect.tokens, suspect.seconds)
            if excess <= 0.0:
                continue
            at = suspect.columns.index(_STATIC_COLUMN)
            for req_id, share in zip(suspect.req_ids, suspect.shares, strict=True):
                slot = table.slots.get(req_id)
                if slot is not None and req_id not in gone:
                    part = warmup_part(share, at, excess / suspect.seconds)
                    table.add([slot], [part], suspect.columns, scale=-1.0)
                    table.outcomes.warmup += part[at]
            self._say(excess, suspect.seconds)

    def _say(self, excess: float, seconds: float) -> None:
        if not self._said:
            self._said = True
            logger.info("vllm_piep: a %.2f s step held %.2f s of one-off work (warm-up); its "
                        "static energy is counted under outcome `warmup`, not billed to the "
                        "step's requests", seconds, excess)


def warmup_part(share: Sequence[float], static_at: int, fraction: float) -> list[float]:
    """The part of a share (prefill, decode, then components; its static value at
    `static_at`) that its step's warm-up time explains: that fraction of its static energy,
    taken from its prefill and decode in their proportion."""
    part = [0.0] * len(share)
    static = share[static_at] * fraction
    part[static_at] = static
    phases = share[0] + share[1]
    part[0] = static * (share[0] / phases) if phases > 0 else 0.0
    part[1] = static - part[0]
    return part
