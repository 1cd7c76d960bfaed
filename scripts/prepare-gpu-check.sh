#!/usr/bin/env bash
# Prepares one call to a GPU machine that has no network, accepts at most 64 MiB of files and
# runs one command for at most 10 minutes (README: "Checking a GPU machine in one call").
# Run from the repository root after `cargo build --release`. Writes target/gpu-check/:
#   infer.gz          the release binary, stripped and gzipped (~8 MB)
#   smollm2-8l.gguf   the real SmolLM2-135M-Instruct Q4_1 cut to its first 8 layers, its
#                     tokenizer and chat template kept (~47 MiB; scripts/cut_gguf.py)
# and checks that the working tree plus target/gpu-check stay under 64 MiB. Then, on the GPU
# machine, from the repository root with target/gpu-check beside it:
#   bash scripts/gpu-check.sh OUT_DIR
# Overridable: BIN (the binary to ship), MODEL (the SmolLM2 GGUF to cut), DEST.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${DEST:-target/gpu-check}
bin=${BIN:-target/release/infer}
limit=$((64 * 1024 * 1024))

[ -x "$bin" ] || { echo "error: no binary at $bin: run \`cargo build --release\` first" >&2; exit 2; }
mkdir -p "$dest"
strip -o "$dest/infer" "$bin"
gzip -9f "$dest/infer"

model=${MODEL:-${INFER_CACHE_DIR:-$HOME/.cache/infer}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ ! -f "$model" ] && [ -z "${MODEL:-}" ]; then
  echo "fetching the embedded SmolLM2 into the cache (once)" >&2
  "$bin" generate --prompt hi --max-tokens 1 >/dev/null
fi
[ -f "$model" ] || { echo "error: no SmolLM2 GGUF at $model: set MODEL=" >&2; exit 2; }
python3 scripts/cut_gguf.py "$model" "$dest/smollm2-8l.gguf" 8

tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
carried=$(du -cb "$dest"/* | tail -1 | cut -f1)
total=$((tree + carried))
echo "working tree $((tree / 1024)) KiB + $dest $((carried / 1024)) KiB = $((total / 1048576)) MiB of 64 MiB"
if [ "$total" -ge "$limit" ]; then
  echo "error: too big for one call ($total bytes)" >&2
  exit 1
fi
