"""The plugin's logger, and logging each distinct failure once."""

from __future__ import annotations

import logging

# Under vLLM's "vllm" logger, so plugin lines are formatted and routed like vLLM's own.
logger = logging.getLogger("vllm.plugins.piep")


class OnceLogger:
    """Logs each distinct failure once, so a broken predictor cannot flood the server log."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def warn(self, where: str, exc: BaseException, consequence: str) -> None:
        key = (where, type(exc).__name__)
        if key in self._seen:
            return
        self._seen.add(key)
        logger.warning("vllm_piep: %s failed (%s: %s); %s. Serving continues; further "
                       "failures of this kind are counted in piep_predictor_errors_total, "
                       "not logged.", where, type(exc).__name__, exc, consequence,
                       exc_info=exc)
