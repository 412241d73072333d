#!/usr/bin/env bash
# README command 1: set up (or reuse) .venv (without the downloads only the tests use), then
# serve the tiny model with the plugin, send one request and print its energy.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" --no-test-downloads
exec "$ROOT/.venv/bin/python" -m vllm_piep.tools.demo --model "${PIEP_TINY_MODEL:-$ROOT/.cache/tiny-llama}" "$@"
