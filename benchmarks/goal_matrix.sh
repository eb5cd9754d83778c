#!/usr/bin/env bash
# Issue 21's goal matrix, one benchmarks/proxy_overhead.py run per case, the floor (tokenizer
# `none`) beside the gateway as shipped in each: 30-token prompts at 10, 100 and 1,000
# streams; 2,000- and 16,000-token prompts, seen (a shared 8-turn history and a new question)
# and new; the 300-stream stall (part C), and with a sweep of the heap keeper's forced every
# second in a twin of the shipped gateway, and due every 0.1 s in another whose keeper chooses
# when it runs (part D). About 15 minutes on the 2-core VM.
#
#   benchmarks/goal_matrix.sh                 # as above, at real-time priority (needs root)
#   benchmarks/goal_matrix.sh --gateway W     # another tree's gateway (docs/benchmarks-proxy.md)
#
# Extra arguments go to every run. Without root, set GOAL_MATRIX_RT= (empty) to run at normal
# priority. The goals and the verdicts so far: docs/benchmarks-proxy.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RT=${GOAL_MATRIX_RT---realtime}
A=(--parts A --repeats 3 --ttft-s 4 --targets gateway,shipped)

run() {
    echo "=== $* ($(date -u +%H:%M:%S) UTC)"
    # shellcheck disable=SC2086  # RT is one flag or none
    "$PY" benchmarks/proxy_overhead.py $RT "$@"
}

run "${A[@]}" --streams 10 "$@"
run "${A[@]}" --streams 100 "$@"
run "${A[@]}" --streams 10 --prompt-words 700 --history seen "$@"
run "${A[@]}" --streams 10 --prompt-words 700 --history fresh "$@"
run "${A[@]}" --streams 10 --prompt-words 5500 --history seen "$@"
run "${A[@]}" --streams 10 --prompt-words 5500 --history fresh "$@"
run --parts A --repeats 2 --ttft-s 8 --streams 1000 --itl-ms 100 --targets gateway,shipped "$@"
run --parts C --stall-streams 300 --stall-repeats 2 --targets shipped "$@"
run --parts D --streams 300 --gc-repeats 3 --gc-s 8 --targets shipped "$@"
