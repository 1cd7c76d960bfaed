#!/usr/bin/env bash
# Time from a stall to `/health` 503, three runs: `infer up --tp 3` (SmolLM2, one thread a
# rank) with rank 2 stalled at its third step by the tests' fault switch (INFER_TEST_FAULT,
# honoured by debug builds only: `cargo build` first); a request is sent and `/health` is
# polled every 50 ms until it answers 503. Prints the seconds from the request to the 503.
#
# Usage: scripts/bench-stall.sh [STALL_TIMEOUT_SECS] (default 10); BIN, PORT override.
set -euo pipefail
bin=${BIN:-target/debug/infer}
timeout_s=${1:-10}
port=${PORT:-8131}
status() { curl -s -o /dev/null -w '%{http_code}' "localhost:$port/health" || true; }
for run in 1 2 3; do
  INFER_TEST_FAULT=stall:rank=2:step=3 "$bin" up --port "$port" --tp 3 --threads 1 \
    --stall-timeout "$timeout_s" >/dev/null 2>&1 &
  up=$!
  for _ in $(seq 1 300); do [ "$(status)" = 200 ] && break; sleep 0.1; done
  start=$(date +%s.%N)
  curl -s -o /dev/null "localhost:$port/v1/completions" -H 'content-type: application/json' \
    -d '{"prompt": "Hi", "max_tokens": 8}' &
  client=$!
  while [ "$(status)" != 503 ]; do sleep 0.05; done
  end=$(date +%s.%N)
  echo "run $run: --stall-timeout $timeout_s: 503 after $(echo "$end - $start" | bc) s"
  kill -TERM "$up"; wait "$up" 2>/dev/null || true
  kill "$client" 2>/dev/null || true
  sleep 1
done
