#!/usr/bin/env bash
# Runs the whole test suite (scripts/test.sh, the README's test command) again and again, on an
# idle machine and with every core kept busy by another process, and prints each run's failures:
# a test that fails in any run depends on something the suite does not control (the machine's
# speed, the order of threads) and is to be fixed at its cause.
#
#   bash scripts/flake-hunt.sh [--idle N] [--loaded N] [--hours H] [--here] [--explore]
#                              [--log-dir DIR]
#
# --idle N, --loaded N  runs without and with the load (default 3 and 3), alternated, idle first
# --hours H             a run is started only while less than H hours have passed (default 5);
#                       an idle run is stopped after 90 minutes, as CI would, a loaded one
#                       after 4.5 hours
# --here                run in this checkout; by default a fresh clone of HEAD in a temporary
#                       directory, set up once, so that editing this checkout during the hunt
#                       changes nothing in it
# --explore             the property tests draw new examples in each run
#                       (HYPOTHESIS_PROFILE=explore) instead of the suite's fixed ones: a case
#                       one finds is a fault to fix, then kept as an @example
# --log-dir DIR         where each run's whole output goes (default: a temporary directory),
#                       with the temporary files of the tests that failed (run-N-tmp/)
#
# The load is one busy loop per core (`stress-ng --cpu N` where stress-ng is on PATH), started
# before the run and stopped after it, and paused while scripts/test.sh runs the tests that
# measure this machine's energy (they run with nothing beside them, as the README asks). Exit status: 0 when every run was green.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
idle=3 loaded=3 hours=5 here=0 log_dir="" profile=suite
while [ "$#" -gt 0 ]; do
  case "$1" in
    --idle) idle="$2"; shift 2 ;;
    --loaded) loaded="$2"; shift 2 ;;
    --hours) hours="$2"; shift 2 ;;
    --here) here=1; shift ;;
    --explore) profile=explore; shift ;;
    --log-dir) log_dir="$2"; shift 2 ;;
    *) echo "flake-hunt: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
for n in "$idle" "$loaded"; do
  [[ "$n" =~ ^[0-9]+$ ]] || { echo "flake-hunt: --idle and --loaded take a count" >&2; exit 2; }
done
[[ "$hours" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "flake-hunt: --hours takes a number" >&2; exit 2; }
log_dir="${log_dir:-$(mktemp -d)}"
mkdir -p "$log_dir"
deadline=$(( $(date +%s) + $(awk -v h="$hours" 'BEGIN { printf "%d", h * 3600 }') ))

tree="$ROOT"
if [ "$here" -eq 0 ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  git clone --quiet "$ROOT" "$tmp/vllm_piep"
  git -C "$tmp/vllm_piep" checkout --quiet --detach "$(git -C "$ROOT" rev-parse HEAD)"
  tree="$tmp/vllm_piep"
  unset PIEP_TINY_MODEL
fi
echo "flake-hunt: $(git -C "$tree" rev-parse --short HEAD) in $tree; logs in $log_dir"
bash "$tree/scripts/setup.sh" >"$log_dir/setup.log" 2>&1 || {
  echo "flake-hunt: setup failed, see $log_dir/setup.log" >&2; exit 1; }

load_pids=()
start_load() {
  local cores; cores="$(nproc)"
  if command -v stress-ng >/dev/null; then
    stress-ng --cpu "$cores" --quiet & load_pids+=("$!")
  else
    for _ in $(seq "$cores"); do
      bash -c 'while :; do :; done' & load_pids+=("$!")
    done
  fi
}
signal_load() {  # STOP or CONT: the load's processes and their children (stress-ng's workers)
  local pid
  for pid in "${load_pids[@]}"; do
    kill "-$1" "$pid" 2>/dev/null
    pkill "-$1" -P "$pid" 2>/dev/null
  done
}
stop_load() {
  [ "${#load_pids[@]}" -gt 0 ] || return 0
  signal_load CONT  # a stopped process takes no TERM
  kill "${load_pids[@]}" 2>/dev/null
  wait "${load_pids[@]}" 2>/dev/null
  load_pids=()
}
# The tests that measure this machine's energy run with nothing beside them (scripts/test.sh's
# third part, as the README asks of the whole command): the load pauses while they run.
pause_load_while_alone() {
  local log="$1" paused=0 want
  while kill -0 "$test_pid" 2>/dev/null; do
    want=0
    grep -q "^test.sh: the end-to-end tests that measure energy" "$log" 2>/dev/null &&
      ! grep -q "^test.sh: the contract tests against vLLM" "$log" && want=1
    if [ "$want" -ne "$paused" ]; then
      if [ "$want" -eq 1 ]; then signal_load STOP; else signal_load CONT; fi
      paused=$want
    fi
    sleep 5
  done
}
test_pid=""
stop_all() {
  [ -n "$test_pid" ] && kill -- "-$test_pid" 2>/dev/null
  stop_load
  exit 130
}
trap stop_all INT TERM

plan=()
for k in $(seq "$(( idle > loaded ? idle : loaded ))"); do
  [ "$k" -le "$idle" ] && plan+=(idle)
  [ "$k" -le "$loaded" ] && plan+=(loaded)
done
summary="$log_dir/summary.md"
echo "| run | load | minutes | result | failed tests |" >"$summary"
echo "|---|---|---|---|---|" >>"$summary"
status=0 run=0 streak=0
for kind in "${plan[@]}"; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "flake-hunt: out of time (--hours $hours); $(( ${#plan[@]} - run )) runs not started"
    status=1; break
  fi
  run=$((run + 1))
  log="$log_dir/run-$run-$kind.log"
  limit=5400  # CI's limit; a run with every core busy takes about three times as long
  [ "$kind" = loaded ] && { start_load; limit=16200; }
  t0=$(date +%s)
  # -rfE: pytest's summary names every failed and erroring test on a line of its own; the
  # temporary directories of failed tests (their servers' logs) are kept, and moved beside the
  # run's log afterwards. TMPDIR itself stays short: vLLM's sockets live there, and a Unix
  # socket's path holds 107 bytes.
  basetemp="$(mktemp -d /tmp/flake-hunt-XXXXXX)"
  # Its own session, so that stopping the hunt stops the run and every server it started.
  (cd "$tree" && TMPDIR="$basetemp" HYPOTHESIS_PROFILE="$profile" PYTEST_ADDOPTS="-rfE -o tmp_path_retention_policy=failed \
      -o tmp_path_retention_count=1000 ${PYTEST_ADDOPTS:-}" \
      exec setsid timeout "$limit" bash scripts/test.sh) >"$log" 2>&1 &
  test_pid=$!
  watch_pid=""
  if [ "$kind" = loaded ]; then pause_load_while_alone "$log" & watch_pid=$!; fi
  wait "$test_pid"
  rc=$?
  test_pid=""
  [ -n "$watch_pid" ] && { kill "$watch_pid" 2>/dev/null; wait "$watch_pid" 2>/dev/null; }
  stop_load
  mv "$basetemp" "$log_dir/run-$run-tmp"
  minutes=$(( ($(date +%s) - t0) / 60 ))
  failed="$(grep -E '^(FAILED|ERROR) ' "$log" | sed -E 's/ - .*//' | sort -u)"
  if [ "$rc" -eq 0 ]; then
    streak=$((streak + 1)); result=green
  else
    streak=0; status=1; result="red (exit $rc)"
  fi
  echo "flake-hunt: run $run ($kind) ${minutes} min: $result"
  [ -n "$failed" ] && echo "$failed" | sed 's/^/  /'
  echo "| $run | $kind | $minutes | $result | $(echo "$failed" | sed -E 's/^(FAILED|ERROR) //' | paste -sd ';' | sed 's/;/, /g') |" >>"$summary"
done
echo "flake-hunt: $run runs, the last $streak green in a row; summary in $summary"
cat "$summary"
exit "$status"
