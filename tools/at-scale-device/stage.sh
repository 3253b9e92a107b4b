#!/bin/bash
# One device call of an at-scale run (pack.sh): keeps this call's part of the model, then runs the
# smoke test (first call) or the run itself (last call). Usage: bash .xfer/K/stage.sh [SECONDS BATCH [ARGS...]]
here=$(dirname "$0")
mkdir -p /tmp/keep
cp "$here"/model.part-* /tmp/keep/
[ -f "$here/prompts.npz.xz" ] && cp "$here/prompts.npz.xz" /tmp/keep/
if ls "$here"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$here"/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
ls -la /tmp/keep
if [ -f "$here/smoke.py" ]; then
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  PYTHONUNBUFFERED=1 timeout 150 python3 "$here/smoke.py" 512
fi
if [ -f "$here/last" ]; then
  BUDGET=${1:-520}; BATCH=${2:-1024}; shift 2 || true
  cat /tmp/keep/model.part-* | python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.decompress(sys.stdin.buffer.read()))" > /tmp/model.gguf
  ls -la /tmp/model.gguf
  PYTHONUNBUFFERED=1 python3 -m dflash.training.at_scale run --gguf /tmp/model.gguf --prompts /tmp/keep/prompts.npz.xz \
      --out "$OUT/run" --seconds "$BUDGET" --batch "$BATCH" --no-save-data "$@" 2>&1 | tee "$OUT/run-stdout.log"
  # One sitting here: the training state (drafter and optimizer, ~150 MB) would not come back anyway.
  rm -f "$OUT/run/checkpoint.pt"
  # Files come back at 16 MiB at most: the checkpoint in parts (cat them back together).
  cd "$OUT/run/drafter" && split -b 15000000 -d model.safetensors model.safetensors.part- && rm model.safetensors
  ls -la "$OUT/run" "$OUT/run/drafter"
fi
