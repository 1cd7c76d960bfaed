#!/usr/bin/env bash
# The planner's prediction error on this host, for SmolLM2 at TP 1, TP 3, PP 2 and DP 2:
# `infer plan` for this host as an inventory of that many CPU ranks, pinned to each layout,
# then `infer bench serve --plan` at the plan's batches (TPOT p50, TTFT p50, tokens/s:
# predicted, measured, error); then the same after `--calibration` with `infer bench decode
# --json` measured here just before. Prints one line per layout, phase, batch and metric.
#
# A layout `MODEL:DTYPE` (`llama-3.1-8b:int4`) plans that model profile at TP 1 in that dtype
# and measures it with random weights of its shape (`--load-format dummy`, int4 as Q4_0,
# int8 as Q8_0); no calibrated phase (the calibration is SmolLM2's).
#
# Usage: scripts/bench-plan-error.sh [LAYOUT]... (default: tp1 tp3 pp2 dp2); BIN (default
# target/release/infer), ISL/OSL (default 256/64), CONCURRENCY (default 1,4) override.
set -euo pipefail
bin=${BIN:-target/release/infer}
isl=${ISL:-256}
osl=${OSL:-64}
concurrency=${CONCURRENCY:-1,4}
layouts=("$@")
[ ${#layouts[@]} -eq 0 ] && layouts=(tp1 tp3 pp2 dp2)
dir=$(mktemp -d)
# Prints $dir/check.json's rows, one line each, for layout $1 and phase $2.
report() {
  python3 - "$dir/check.json" "$1" "$2" <<'PY'
import json, sys
check = json.load(open(sys.argv[1]))
for row in check["rows"]:
    scale = 1e3 if row["metric"].endswith("_secs") else 1
    unit = "ms" if scale == 1e3 else "tok/s"
    print(f'{sys.argv[2]} {sys.argv[3]:10} batch {row["concurrency"]:>2} {row["metric"]:14} '
          f'predicted {row["predicted"] * scale:8.1f} {unit:5} measured {row["measured"] * scale:8.1f} '
          f'error {row["relative_error"] * 100:+6.0f}%')
PY
}
for layout in "${layouts[@]}"; do
  if [[ $layout == *:* ]]; then
    "$bin" plan --cluster local --model "${layout%%:*}" --dtype "${layout##*:}" --tp 1 --pp 1 \
      --dp 1 --max-model-len 4096 --isl "$isl" --osl "$osl" --json >"$dir/plan.json"
    "$bin" bench serve --plan "$dir/plan.json" --load-format dummy --concurrency "$concurrency" \
      --json >"$dir/check.json"
    report "$layout" dummy
    continue
  fi
  degree=${layout:0:2}
  n=${layout:2}
  printf '[[hosts]]\nname = "local"\naddress = "127.0.0.1"\ncpu-ranks = %s\n' "$n" \
    >"$dir/hosts.toml"
  for phase in probed calibrated; do
    calibration=()
    if [ "$phase" = calibrated ]; then
      # Measured just before, as a user calibrates: a shared VM's speed drifts by a third
      # within minutes.
      "$bin" bench decode --json >"$dir/decode.json"
      calibration=(--calibration "$dir/decode.json")
    fi
    "$bin" plan --cluster "$dir/hosts.toml" "--$degree" "$n" --isl "$isl" --osl "$osl" \
      "${calibration[@]}" --json >"$dir/plan.json"
    "$bin" bench serve --plan "$dir/plan.json" --concurrency "$concurrency" --json \
      >"$dir/check.json"
    report "$layout" "$phase"
  done
done
rm -rf "$dir"
