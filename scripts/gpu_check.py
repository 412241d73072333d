#!/usr/bin/env python3
"""The GPU check (docs/gpu-validation.md): the plugin's GPU parts against a real GPU.

    python3 scripts/gpu_check.py [--out DIR] [--sections nvml,prior] [--dry-run]

`scripts/gpu-check.sh` installs the carried wheels and runs this. With `--dry-run` the sections
run on this machine's CPU against the stand-ins of tests/support (a `pynvml` module, CUDA
events on a simulated stream): the test suite runs it so that the check works when a GPU is
at hand; what it reports is the stand-ins', never a measurement.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "tests" / "support"


def main() -> int:
    argv = sys.argv[1:]
    dry = "--dry-run" in argv
    # The sections and their subprocesses (`python -m vllm_piep.meters`, `kernels_trace`)
    # import the package from this checkout; a dry run's find the stand-in `pynvml` first.
    paths = [str(ROOT)] + ([str(SUPPORT / "standin_pynvml"), str(SUPPORT)] if dry else [])
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(
        paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    from vllm_piep.tools.gpu_check.cli import main as check

    if dry:
        from gpu_check_standins import StandinBackend as backend
    else:
        from vllm_piep.tools.gpu_check.backend import CudaBackend as backend
    return check(argv, backend, [sys.executable, str(Path(__file__).resolve())])


if __name__ == "__main__":
    sys.exit(main())
