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

if [ "$#" -gt 0 ]; then
  run_pytest "$@"
  exit $?
fi
# The whole suite: the unit tests and the contract tests against the installed vLLM in two
# processes, a test module each at a time (a module's fixtures are built once); then the tests
# that start vLLM servers, two modules at a time (a server's start is mostly one process
# importing vLLM at a time, on one core), except those that measure this machine's energy,
# which run after them with nothing beside them; then the contract tests against the vLLM that
# GPU users run: the 0.33.0 CUDA build's Python source, which setup.sh downloaded, on CPU torch.
# Each part prints its 25 slowest tests.
status=0
note() { [ "$1" -ne 0 ] && [ "$status" -eq 0 ] && status=$1; return 0; }
echo "test.sh: the unit and contract tests (2 processes)"
run_pytest tests/unit tests/vllm_contract -n 2 --dist loadscope --durations=25
note $?
echo "test.sh: the end-to-end tests (real vLLM servers, two modules at a time)"
run_pytest tests/e2e -m "not alone" -n 2 --dist loadfile --durations=25
note $?
echo "test.sh: the end-to-end tests that measure energy (with nothing beside them)"
run_pytest tests/e2e -m alone --durations=25
note $?
echo "test.sh: the contract tests against vLLM 0.33.0 (GPU build's source)"
PYTHONPATH="$ROOT/.cache/vllm033/src${PYTHONPATH:+:$PYTHONPATH}" PIEP_EXPECT_VLLM=0.33.0 \
  run_pytest tests/vllm_contract -p no:cacheprovider -n 2 --dist loadscope --durations=25
note $?
exit "$status"
