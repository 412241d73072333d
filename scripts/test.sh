#!/usr/bin/env bash
# README command 2: set up (or reuse) .venv, then run the whole test suite.
# pytest's exit code 5 ("no tests collected") is a failure here: a suite that ran nothing
# proves nothing.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" || exit 1
cd "$ROOT"
export PIEP_TINY_MODEL="${PIEP_TINY_MODEL:-$ROOT/.cache/tiny-llama}"
"$ROOT/.venv/bin/python" -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; treating that as a failure" >&2
  exit 1
fi
exit "$status"
