#!/usr/bin/env bash
# Checks `infer` on a GPU machine in one call (README: "Checking a GPU machine in one call"):
# at most BUDGET seconds (330 by default, under 6 minutes), every step under its own timeout,
# no network needed. Reads target/gpu-check/ (scripts/prepare-gpu-check.sh): infer.gz and
# smollm2-8l.gguf. Writes into OUT_DIR (the first argument, else $OUT) two files:
#   summary.txt    each step's exit code and seconds, then the figures: GPU vs CPU greedy
#                  tokens, decode tok/s, GB/s and % of the HBM datasheet, launches per step
#                  and Nsight Compute's time per kernel of a decode step (when ncu exists)
#   gpu-check.tgz  everything: machine facts, the libraries found, `infer smoke --json`, the
#                  generations, every `bench decode --json`, ncu's CSV, sanitizer reports, the
#                  logs
# Overridable: INFER_BIN (a binary to run instead of infer.gz), MODEL (instead of the cut
# SmolLM2), BUDGET (seconds), DUMMY_DTYPES (default "q4_0 q8_0 bf16").
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-}}
[ -n "$out" ] || { echo "usage: scripts/gpu-check.sh OUT_DIR" >&2; exit 2; }
mkdir -p "$out"
work=$(mktemp -d /tmp/gpu-check.XXXXXX)
logs="$work/logs"
mkdir -p "$logs"
summary="$logs/summary.txt"
: > "$summary"
finish() {
  tar czf "$out/gpu-check.tgz" -C "$logs" .
  cp "$summary" "$out/summary.txt"
}
trap finish EXIT
start=$(date +%s)
budget=${BUDGET:-330}
left() { echo $((budget - ($(date +%s) - start))); }

# step NAME TIMEOUT COMMAND...: stdout to NAME.out, stderr to NAME.err, a summary line.
step() {
  local name=$1 limit=$2
  shift 2
  local remaining
  remaining=$(left)
  if [ "$remaining" -lt 15 ]; then
    echo "$name skipped: no time left" >> "$summary"
    return 99
  fi
  [ "$limit" -gt $((remaining - 10)) ] && limit=$((remaining - 10))
  local began
  began=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$logs/$name.out" 2> "$logs/$name.err"
  local rc=$?
  echo "$name rc=$rc secs=$(($(date +%s) - began)) (timeout $limit)" >> "$summary"
  return $rc
}

# The machine.
{
  date -u; uname -a; grep PRETTY_NAME /etc/os-release; ldd --version 2>&1 | head -1; nproc
  free -g | head -2
  nvidia-smi
  nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,memory.used --format=csv
  env | grep -E '^(CUDA|LD_LIBRARY_PATH|NVIDIA|PATH|VIRTUAL_ENV|CONDA_PREFIX)='
  command -v nvcc compute-sanitizer python3 nsys ncu
} > "$logs/machine.txt" 2>&1
{
  python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
  for dir in $(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)/nvidia/*/lib \
      /usr/local/cuda*/lib64; do
    ls -la "$dir" 2>/dev/null | grep -E 'libnvrtc|libcublas|libnccl|libcudart'
  done
  ldconfig -p | grep -E 'libcuda\.|libnvrtc|libcublas|libnccl'
} > "$logs/libraries.txt" 2>&1

# The binary and the model.
bin=${INFER_BIN:-$work/infer}
if [ -z "${INFER_BIN:-}" ]; then
  gzip -dc target/gpu-check/infer.gz > "$bin" && chmod +x "$bin"
fi
model=${MODEL:-target/gpu-check/smollm2-8l.gguf}
export INFER_CACHE_DIR="$work/cache" RUST_BACKTRACE=1
if ! "$bin" --version > "$logs/version.txt" 2>&1; then
  echo "the binary does not run here (glibc?): see version.txt" >> "$summary"
  exit 3
fi

step smoke 120 "$bin" smoke --json --model "$model"
prompt="The capital of France is"
step generate_cuda 60 "$bin" generate --device cuda --model "$model" --prompt "$prompt" --max-tokens 32 --json
step generate_cpu 60 "$bin" generate --device cpu --model "$model" --prompt "$prompt" --max-tokens 32 --json
step bench_smollm2 60 "$bin" bench decode --device cuda --model "$model" --runs 2 --decode-tokens 64 --json
for dtype in ${DUMMY_DTYPES:-q4_0 q8_0 bf16}; do
  step "bench_llama8b_$dtype" 75 "$bin" bench decode --device cuda --load-format dummy \
    --model llama-3.1-8b --dtype "$dtype" --runs 2 --decode-tokens 64 --json
done
# GPU time per kernel of a Q4_0 decode (the bench's stderr; its top rows go in the summary).
step profile_llama8b_q4_0 75 env INFER_CUDA_PROFILE=1 "$bin" bench decode --device cuda \
  --load-format dummy --model llama-3.1-8b --dtype q4_0 --runs 1 --decode-tokens 32
# Nsight Compute, when the machine has it: each kernel's own GPU time and DRAM bytes read over
# 400 launches of batch-1 Q4_0 decode (a 1-token prompt, so every launch is a decode step's;
# the first 800, module loads and first steps, skipped), summed by kernel and grid below.
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ -n "$ncu" ]; then
  step ncu_llama8b_q4_0 90 "$ncu" --clock-control none --cache-control none --launch-skip 800 \
    --launch-count 400 --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread \
    "$bin" bench decode --device cuda --load-format dummy --model llama-3.1-8b --dtype q4_0 \
    --prompt-tokens 1 --decode-tokens 4 --runs 1 --json
else
  echo "ncu: not on this machine" >> "$summary"
fi
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$sanitizer" ]; then
  step memcheck 90 "$sanitizer" --tool memcheck --error-exitcode 9 "$bin" generate --device cuda \
    --model "$model" --prompt "$prompt" --max-tokens 4
  step racecheck 60 "$sanitizer" --tool racecheck --error-exitcode 9 "$bin" generate --device cuda \
    --model "$model" --prompt "$prompt" --max-tokens 2
else
  echo "compute-sanitizer: not on this machine" >> "$summary"
fi
nvidia-smi --query-gpu=memory.used --format=csv >> "$logs/machine.txt" 2>&1

# The figures, from the JSON the steps wrote.
python3 - "$logs" >> "$summary" 2>&1 <<'EOF'
import json, pathlib, sys
logs = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((logs / f"{name}.out").read_text())
    except Exception:
        return None
smoke = load("smoke")
if smoke:
    failed = [c["name"] for c in smoke["checks"] if not c["passed"]]
    print(f"smoke: {len(smoke['checks']) - len(failed)} of {len(smoke['checks'])} rows pass" +
          (f"; failing: {', '.join(failed)}" if failed else ""))
    for lib in smoke.get("libraries", []):
        print(f"  {lib['library']}: {lib['path'] or lib['soname'] + ' (system loader)'}")
gpu, cpu = load("generate_cuda"), load("generate_cpu")
if gpu and cpu:
    same = gpu["tokens"] == cpu["tokens"]
    first = next((i for i, (a, b) in enumerate(zip(gpu["tokens"], cpu["tokens"])) if a != b), None)
    print(f"greedy tokens GPU vs CPU: {'equal' if same else f'differ from position {first}'}")
for path in sorted(logs.glob("bench_*.out")):
    report = load(path.stem)
    if not report:
        continue
    for row in report.get("batches", []):
        hbm = row.get("hbm_fraction")
        print(f"{path.stem}: batch {row['batch']}: {row['decode_tokens_per_sec']:.1f} tok/s, "
              f"{row['weight_bytes_per_sec'] / 1e9:.0f} GB/s" +
              (f" = {100 * hbm:.0f}% of HBM" if hbm else "") +
              (f", {row['launches_per_step']:.0f} launches/step" if row.get("launches_per_step") else "") +
              (f", host issues a step in {1e3 * row['issue_step_secs']:.2f} of {1e3 * row['decode_step_secs']:.2f} ms"
               if row.get("issue_step_secs") else ""))
# Nsight Compute's rows (CSV among the bench's own output): time and GB/s by kernel and grid.
import csv
try:
    rows = list(csv.reader((logs / "ncu_llama8b_q4_0.out").read_text().splitlines()))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    column = {name: i for i, name in enumerate(rows[head])}
    number = lambda text: float(text.replace(",", ""))
    kernels = {}
    for r in rows[head + 2:]:
        if len(r) != len(rows[head]):
            continue
        key = (r[column["Kernel Name"]], r[column["launch__grid_size"]],
               r[column["launch__registers_per_thread"]])
        k = kernels.setdefault(key, [0, 0.0, 0.0])
        k[0] += 1
        k[1] += number(r[column["gpu__time_duration.sum"]])
        k[2] += number(r[column["dram__bytes_read.sum"]])
    total = sum(k[1] for k in kernels.values())
    print(f"ncu: {sum(k[0] for k in kernels.values())} launches of batch-1 Q4_0 decode, "
          f"{total / 1e3:.0f} µs of kernels")
    for (name, grid, registers), (n, ns, read) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name[:28]:28} grid {grid:>7} {registers:>3} regs {n:4}x {ns / n / 1e3:7.2f} µs "
              f"{read / n / 1e6:8.2f} MB read {read / ns if ns else 0:6.0f} GB/s")
except (OSError, StopIteration, KeyError, ValueError):
    pass
EOF
grep -A 14 "GPU time per kernel" "$logs/profile_llama8b_q4_0.err" >> "$summary" 2>/dev/null
echo "total $(($(date +%s) - start)) s of $budget" >> "$summary"
