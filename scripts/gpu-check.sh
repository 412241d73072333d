#!/usr/bin/env bash
# The GPU check (docs/gpu-validation.md): the plugin's GPU parts against a real GPU, in one run.
#
#   bash scripts/gpu-check.sh --fetch-wheels [--python-version X.Y]
#                                    # where pip reaches PyPI: .whl/, what the GPU machine's
#                                    # Python lacks of the package's dependencies (~3.5 MB)
#   bash scripts/gpu-check.sh [--out DIR] [...]     # on the GPU machine (no network needed):
#                                                   # .whl/ into a temporary site, then the check
#   bash scripts/gpu-check.sh --dry-run [--out DIR] # on a CPU, against stand-ins (the tests do)
#
# The interpreter: $PYTHON when set, else the checkout's .venv/bin/python when it exists, else
# python3 on PATH; the first line printed names it and why. The wheels are for its CPython
# version unless --python-version names the GPU machine's. Other options go to
# scripts/gpu_check.py (--sections, --budget, --budget-scale). Exit 1: a section failed
# (summary.json names it); 2: bad input.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/.whl"
MIN_PYTHON=3.11  # pyproject.toml's requires-python
# The wheels a GPU machine's image lacks, at the versions the test suite runs with.
WHEEL_LIST="$ROOT/scripts/gpu-wheels.txt"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# Bad input: one line on stderr, exit 2.
die() {
  echo "gpu-check: $*" >&2
  exit 2
}

# Whether X.Y is a Python version at least MIN_PYTHON.
supported() {
  [[ "$1" =~ ^([0-9]+)\.([0-9]+)$ ]] || return 1
  local major="${BASH_REMATCH[1]}" minor="${BASH_REMATCH[2]}"
  (( major > ${MIN_PYTHON%%.*} || (major == ${MIN_PYTHON%%.*} && minor >= ${MIN_PYTHON#*.}) ))
}

# Sets PYTHON, PY_PATH, PY_VERSION and PY_TORCH (1 when torch is importable) and says which
# interpreter runs and why.
choose_python() {
  local why facts
  if [ -n "${PYTHON:-}" ]; then
    why="PYTHON is set"
  elif [ -x "$ROOT/.venv/bin/python" ]; then
    PYTHON="$ROOT/.venv/bin/python" why="the checkout's .venv"
  else
    PYTHON=python3 why="python3 on PATH: the checkout has no .venv"
  fi
  PY_PATH="$(command -v "$PYTHON")" || die "PYTHON=$PYTHON: no such command"
  facts="$("$PYTHON" -c 'import importlib.util as u, sys
print("%d.%d" % sys.version_info[:2], int(u.find_spec("torch") is not None))' 2>/dev/null)" \
    || die "$PY_PATH ($why) does not run: set PYTHON to a Python $MIN_PYTHON or newer"
  read -r PY_VERSION PY_TORCH <<<"$facts"
  echo "gpu-check: python $PY_PATH, $PY_VERSION ($why)"
}

# pip, quiet: its output only when it fails (without index-location warnings).
pip_quiet() {
  local out
  if ! out="$("$PYTHON" -m pip -q "$@" 2>&1)"; then
    printf '%s\n' "$out" | grep -v '^WARNING: Location' >&2
    return 1
  fi
}

# --fetch-wheels [--python-version X.Y]: the wheels for CPython X.Y (default: the interpreter's).
fetch_wheels() {
  local target="$PY_VERSION"
  while [ $# -gt 0 ]; do
    case "$1" in
      --fetch-wheels) ;;
      --python-version) [ $# -ge 2 ] || die "--python-version: expected X.Y"; target="$2"; shift ;;
      --python-version=*) target="${1#*=}" ;;
      *) die "$1: --fetch-wheels takes only --python-version X.Y" ;;
    esac
    shift
  done
  supported "$target" || die "--python-version $target: expected X.Y, $MIN_PYTHON or newer"
  [ -f "$WHEEL_LIST" ] || die "$WHEEL_LIST is missing: it lists the wheels to fetch"
  local specs
  mapfile -t specs < <(grep '==' "$WHEEL_LIST")
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  pip_quiet download --no-deps --only-binary=:all: --python-version "$target" \
    --implementation cp "${PLATFORMS[@]}" -d "$WHEELS" "${specs[@]}"
  # The wheels install for that CPython on x86-64 Linux, as they will there (nothing installed).
  pip_quiet install --dry-run --no-index --no-deps --only-binary=:all: --python-version \
    "$target" --implementation cp "${PLATFORMS[@]}" --target "$(mktemp -d)" "$WHEELS"/*.whl
  echo "gpu-check: $(ls "$WHEELS" | wc -l) wheels for CPython $target, $(du -sh "$WHEELS" | cut -f1) in $WHEELS"
}

# The CPython version the wheels in .whl/ were fetched for ("" when only pure-Python ones).
wheels_version() {
  ls "$WHEELS" | sed -n 's/.*-cp\([0-9]\)\([0-9]*\)-cp[0-9]*-.*\.whl$/\1.\2/p' | sort -u | paste -sd' '
}

choose_python
for arg in "$@"; do
  if [ "$arg" = "--fetch-wheels" ]; then
    fetch_wheels "$@"
    exit 0
  fi
done

dry=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry=1; done
supported "$PY_VERSION" || die "$PY_PATH is Python $PY_VERSION; the package needs $MIN_PYTHON or newer: set PYTHON"
[ "$PY_TORCH" = 1 ] || die "$PY_PATH has no torch, which the check needs: set PYTHON to one that has"
if [ "$dry" -eq 0 ]; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    die "no wheels in $WHEELS: run 'bash scripts/gpu-check.sh --fetch-wheels' where pip reaches PyPI, and copy .whl/ into the checkout"
  fi
  fetched="$(wheels_version)"
  if [ -n "$fetched" ] && [ "$fetched" != "$PY_VERSION" ]; then
    die "the wheels in $WHEELS are for CPython $fetched, $PY_PATH is $PY_VERSION: run 'bash scripts/gpu-check.sh --fetch-wheels --python-version $PY_VERSION'"
  fi
  SITE="$(mktemp -d -t gpu-check-site.XXXXXX)"
  trap 'rm -rf "$SITE"' EXIT
  pip_quiet install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
[ "$dry" -eq 1 ] && exec "$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"
# Not exec: the EXIT trap removes the temporary site when the check ends.
"$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"
