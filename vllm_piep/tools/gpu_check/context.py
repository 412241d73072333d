"""What a section gets: its report, the backend, a scratch folder, and NVML."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_piep.tools.gpu_check.backend import Backend
from vllm_piep.tools.gpu_check.report import SectionReport, SectionSkipped

# NVML constants the sections use (nvml.h), so that a stand-in need not define them.
NVML_CLOCK_GRAPHICS, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2


@dataclass
class Context:
    report: SectionReport
    backend: Backend
    scratch: Path  # files the section makes that do not go to the results

    @contextmanager
    def nvml(self) -> Iterator[Any]:
        """The `pynvml` module, initialised (skips the section, in one line, without it)."""
        try:
            import pynvml
        except ImportError as exc:
            raise SectionSkipped(f"no NVML: cannot import pynvml ({exc})") from exc
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001  (NVMLError_LibraryNotFound, DriverNotLoaded)
            raise SectionSkipped(f"no NVML: nvmlInit failed ({type(exc).__name__}: {exc})"
                                 ) from exc
        try:
            yield pynvml
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001  (shutting down: nothing left to report)
                pass


def maybe(call: Any, *args: Any) -> Any:
    """An NVML query that an older driver or a stand-in may not answer: None then."""
    try:
        value = call(*args)
    except Exception:  # noqa: BLE001  (NotSupported, FunctionNotFound, AttributeError)
        return None
    return value.decode() if isinstance(value, bytes) else value


def nvml_call(nvml: Any, name: str, *args: Any) -> Any:
    """`maybe` by name: None when the module has no such function."""
    fn = getattr(nvml, name, None)
    return None if fn is None else maybe(fn, *args)
