#!/usr/bin/env bash
# The GPU check (docs/gpu-validation.md): the plugin's GPU parts against a real GPU, in one run.
#
#   bash scripts/gpu-check.sh --fetch-wheels        # here (with network): .whl/, what the GPU
#                                                   # machine's image lacks (~5 MB)
#   bash scripts/gpu-check.sh [--out DIR] [...]     # on the GPU machine (no network): installs
#                                                   # .whl/ into a temporary site, runs the check
#   bash scripts/gpu-check.sh --dry-run [--out DIR] # on a CPU, against stand-ins (the tests do)
#
# Other options go to scripts/gpu_check.py (--sections, --budget-scale). Exit 1: a section
# failed (summary.json names it); 2: bad input.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/.whl"
PYTHON="${PYTHON:-python3}"
# The package's pure-Python dependencies the image (scripts/gpu-image-packages.txt) lacks, at
# the versions the test suite runs with; pydantic-core, msgspec and rpds-py are compiled.
WHEEL_SPECS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 msgspec==0.22.0 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# pip, quiet: its output only when it fails (without this machine's index-location warnings).
pip_quiet() {
  local out
  if ! out="$("$PYTHON" -m pip -q "$@" 2>&1)"; then
    printf '%s\n' "$out" | grep -v '^WARNING: Location' >&2
    return 1
  fi
}

if [ "${1:-}" = "--fetch-wheels" ]; then
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  pip_quiet download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$WHEELS" "${WHEEL_SPECS[@]}"
  # The wheels install for CPython 3.12 on x86-64 Linux, as they will there (nothing installed).
  pip_quiet install --dry-run --no-index --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" --target "$(mktemp -d)" "$WHEELS"/*.whl
  echo "gpu-check: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS"
  exit 0
fi

dry=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry=1; done
if [ "$dry" -eq 0 ]; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu-check: no wheels in $WHEELS: run 'bash scripts/gpu-check.sh --fetch-wheels' where pip reaches PyPI, and carry .whl/" >&2
    exit 2
  fi
  SITE="$(mktemp -d -t gpu-check-site.XXXXXX)"
  trap 'rm -rf "$SITE"' EXIT
  pip_quiet install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"
