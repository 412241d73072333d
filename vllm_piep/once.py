"""The plugin's logger, and logging each distinct failure once."""

from __future__ import annotations

import logging
from collections.abc import Callable

# Under vLLM's "vllm" logger, so plugin lines are formatted and routed like vLLM's own.
logger = logging.getLogger("vllm.plugins.piep")


class OnceLogger:
    """Logs each distinct failure once, so a broken predictor cannot flood the server log.

    further: what the line says about later failures of the same kind (true for the caller);
    traceback: whether a failure's traceback is worth logging (bugs, not bad input)."""

    def __init__(self, further: str = "further failures of this kind are counted in "
                 "piep_predictor_errors_total, not logged",
                 traceback: Callable[[BaseException], bool] = lambda exc: True) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._further = further
        self._traceback = traceback

    def warn(self, where: str, exc: BaseException, consequence: str) -> None:
        key = (where, type(exc).__name__)
        if key in self._seen:
            return
        self._seen.add(key)
        logger.warning("vllm_piep: %s failed (%s: %s); %s. Serving continues; %s.", where,
                       type(exc).__name__, exc, consequence, self._further,
                       exc_info=exc if self._traceback(exc) else None)
