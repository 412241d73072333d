"""Entry point of the `vllm.general_plugins` group: `piep = vllm_piep.plugin:register`.

vLLM calls `register()` in every process it starts (API server, engine core, workers), maybe
several times: it must be idempotent, cheap, and never raise. Loaded but not enabled, it only
adds the `--plugins` flag; enabled (`--plugins piep`, or VLLM_PLUGINS naming `piep`), it
installs the hooks in `vllm_piep.runtime.install`.
"""

from __future__ import annotations

from vllm_piep.config import is_enabled
from vllm_piep.once import logger


def register() -> None:
    try:
        from vllm_piep.runtime import install

        install.install_cli_flag()
        if is_enabled():
            if install.activate():
                logger.info("vllm_piep: per-request energy is on (usage.energy, /metrics)")
            else:
                logger.warning("vllm_piep: vLLM %s lacks a method the per-request energy "
                               "needs (named above); the plugin changes nothing there and "
                               "vLLM serves without usage.energy", install.vllm_version())
    except Exception:  # a plugin that raises here would stop vLLM from starting
        logger.exception("vllm_piep: failed to register; vLLM runs without the plugin")
