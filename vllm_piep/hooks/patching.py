"""A small, reversible, idempotent method patch.

Each `Patch` names its target, why it exists, and what it wraps. `install()` refuses (returns
False, logs why) when the target does not have the attribute it expects, so an upstream vLLM
that moved things is left untouched instead of half-patched. `uninstall()` restores the
original, which the tests use to put vLLM back as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_piep.once import logger

_MARK = "__piep_patch__"
_ORIGINAL = "__piep_original__"


@dataclass
class Patch:
    target: type
    name: str
    make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]
    why: str

    @property
    def key(self) -> str:
        return f"{self.target.__module__}.{self.target.__qualname__}.{self.name}"

    @property
    def installed(self) -> bool:
        raw = self.target.__dict__.get(self.name)
        func = getattr(raw, "__func__", raw)
        return getattr(func, _MARK, None) == self.key

    def install(self) -> bool:
        if self.installed:
            return True
        raw = self.target.__dict__.get(self.name)
        if raw is None:
            logger.warning("vllm_piep: not patching %s: this vLLM has no such attribute "
                           "(%s). The plugin's feature that needs it is off.", self.key,
                           self.why)
            return False
        kind: Callable[[Any], Any] | None = None
        func = raw
        if isinstance(raw, (staticmethod, classmethod)):
            kind, func = type(raw), raw.__func__
        wrapper = functools.wraps(func)(self.make_wrapper(func))
        setattr(wrapper, _MARK, self.key)
        setattr(wrapper, _ORIGINAL, raw)  # kept on the wrapper: any Patch object can undo it
        setattr(self.target, self.name, kind(wrapper) if kind else wrapper)
        return True

    def uninstall(self) -> None:
        if self.installed:
            raw = self.target.__dict__[self.name]
            setattr(self.target, self.name, getattr(getattr(raw, "__func__", raw), _ORIGINAL))


def install_all(patches: list[Patch]) -> bool:
    """Install every patch or none: a partial set would account energy inconsistently."""
    if all(p.target.__dict__.get(p.name) is not None for p in patches):
        return all([p.install() for p in patches])
    for p in patches:
        if p.target.__dict__.get(p.name) is None:
            p.install()  # logs the refusal
    return False


def uninstall_all(patches: list[Patch]) -> None:
    for p in reversed(patches):
        p.uninstall()
