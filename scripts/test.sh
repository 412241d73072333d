#!/usr/bin/env bash
# README command 2: set up (or reuse) .venv, then run the whole test suite.
# pytest's exit code 5 ("no tests collected") is a failure here: a suite that ran nothing
# proves nothing.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" || exit 1
cd "$ROOT"
export PIEP_TINY_MODEL="${PIEP_TINY_MODEL:-$ROOT/.cache/tiny-llama}"
run_pytest() {
  "$ROOT/.venv/bin/python" -m pytest "$@"
  local status=$?
  if [ "$status" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; treating that as a failure" >&2
    return 1
  fi
  return "$status"
}

run_pytest "$@"
status=$?
# The whole suite (no arguments) also runs the contract tests against the vLLM that GPU users
# run: the 0.33.0 CUDA build's Python source, which setup.sh downloaded, on CPU torch.
if [ "$#" -eq 0 ]; then
  echo "test.sh: the contract tests against vLLM 0.33.0 (GPU build's source)"
  PYTHONPATH="$ROOT/.cache/vllm033/src${PYTHONPATH:+:$PYTHONPATH}" PIEP_EXPECT_VLLM=0.33.0 \
    run_pytest tests/vllm_contract -p no:cacheprovider
  contract=$?
  [ "$status" -eq 0 ] && status=$contract
fi
exit "$status"
