# verispec set-up. `make demo` runs the main job, `make test` runs the test suite; both create
# the virtual environment on first use.
#
# TORCH_SPEC picks the torch build. The default is the CPU build that this kind of machine has
# on local disk; with a GPU, pass your CUDA build instead, e.g.
#   make setup TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu126"

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEMO_PROMPT ?= Write a Python function that returns the n-th Fibonacci number, with a docstring.

.PHONY: setup demo test test-long test-fast bench-decode bench-spec bench-report bench-adaptive bench-suffix \
	bench-tree bench-batch bench-server bench-agent bench-scale bench-kernels clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[test,server,bench,ray]"
	$(PY) -c "import verispec.kernels as k; k.available()"  # build the native CPU kernels once
	touch $@

# The main job: Qwen2.5-Coder-1.5B-Instruct answers a chat prompt, with the 0.5B model drafting
# (fetched and verified on first use), then plain decoding runs on the same prompt for the
# speedup and an identity check.
demo: setup
	$(VENV)/bin/verispec generate qwen2.5-coder-1.5b-instruct "$(DEMO_PROMPT)" \
		--speculative-model qwen2.5-coder-0.5b-instruct --num-speculative-tokens 4 \
		--max-tokens 128 --threads 2 --compare-plain

# The suite, real-model tests included (models are fetched on first use); `make test-long` adds
# further settings of checks it already makes.
test: setup
	$(PY) -m pytest -q --durations=15

# Further settings of checks the suite already makes (minutes each).
test-long: setup
	$(PY) -m pytest -q -m long

# Unit tests only: tiny random models, no downloads.
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not long"

bench-decode: setup
	$(VENV)/bin/verispec bench decode

# The native kernels: per-shape cost against rows, a verify pass against a decode step
# (docs/kernels.md).
bench-kernels: setup
	$(VENV)/bin/verispec bench kernels

# The benchmark presets (`verispec bench --help` lists them), with the settings of the reports
# in docs/benchmarks/. The two long reports take hours each on a 2-core CPU: Ctrl-C writes a
# partial report, and `make bench-report RESUME=--resume` (or bench-adaptive) continues it,
# running only the question blocks it lacks.
bench-spec: setup
	$(VENV)/bin/verispec bench spec

bench-report: setup
	$(VENV)/bin/verispec bench report $(RESUME)

bench-adaptive: setup
	$(VENV)/bin/verispec bench adaptive $(RESUME)

bench-suffix: setup
	$(VENV)/bin/verispec bench suffix --questions 8 --max-tokens 192

bench-tree: setup
	$(VENV)/bin/verispec bench tree --num-questions 10 --max-tokens 48 --depth 5 \
		--topk 2 --budget 6 --temperatures 0,1

bench-batch: setup
	$(VENV)/bin/verispec bench batch

bench-server: setup
	$(VENV)/bin/verispec bench server

# Tool-calling conversations end to end; LLAMA_BIN (a directory with llama-server, built as the
# README shows) adds llama-server's modes beside verispec (docs/benchmarks/agent.md).
bench-agent: setup
	$(VENV)/bin/verispec bench agent $(if $(LLAMA_BIN),--llama-bin $(LLAMA_BIN))

# One server against Ray Serve with 1 and with 2 replicas on the same cores (docs/scaling.md).
bench-scale: setup
	$(VENV)/bin/verispec bench scale

clean:
	rm -rf $(VENV) .pytest_cache
