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

.PHONY: setup demo test test-long test-fast bench-decode bench-spec bench-report bench-adaptive clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[test,server,bench]"
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
	$(PY) -m pytest -q

# Further settings of checks the suite already makes (minutes each).
test-long: setup
	$(PY) -m pytest -q -m long

# Unit tests only: tiny random models, no downloads.
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not long"

bench-decode: setup
	$(PY) benchmarks/bench_decode.py

bench-spec: setup
	$(PY) benchmarks/bench_spec.py

# The two long reports under docs/benchmarks/ (hours each on a 2-core CPU). Ctrl-C writes a
# partial report; `make bench-report RESUME=--resume` (or bench-adaptive) continues it, running
# only the question blocks it lacks.
TARGET := qwen2.5-coder-1.5b-instruct
DRAFT := draft_model:qwen2.5-coder-0.5b-instruct
REPORT_METHODS := plain,ngram@k=4,suffix@k=8,lookahead@k=3,$(DRAFT)@k=4,quantization=int4,\
$(DRAFT)@k=5,draft_topk=2,num_draft_tokens=6,quantization=int4,hf:plain,hf:assisted:qwen2.5-coder-0.5b-instruct,\
hf:prompt_lookup,llamacpp:plain,llamacpp:prompt_lookup
ADAPTIVE_METHODS := plain,ngram@k=8,\
ngram@k=1,adaptive=false,ngram@k=2,adaptive=false,ngram@k=4,adaptive=false,ngram@k=6,adaptive=false,\
ngram@k=8,adaptive=false,$(DRAFT)@k=8,quantization=int4,$(DRAFT)@k=1,adaptive=false,quantization=int4,\
$(DRAFT)@k=2,adaptive=false,quantization=int4,$(DRAFT)@k=4,adaptive=false,quantization=int4,\
$(DRAFT)@k=6,adaptive=false,quantization=int4,$(DRAFT)@k=8,adaptive=false,quantization=int4
ALL_CATEGORIES := writing,roleplay,reasoning,math,coding,extraction,stem,humanities,translation,summarization,qa,math_reasoning,rag

bench-report: setup
	$(VENV)/bin/verispec bench --model $(TARGET) --quantization int4 --threads 2 --num-questions 3 \
		--max-tokens 128 --out docs/benchmarks/spec-bench --no-progress --methods "$(REPORT_METHODS)" $(RESUME)

bench-adaptive: setup
	$(VENV)/bin/verispec bench --model $(TARGET) --quantization int4 --threads 2 --categories $(ALL_CATEGORIES) \
		--num-questions 3 --max-tokens 128 --max-turns 1 --out docs/benchmarks/adaptive --no-progress \
		--methods "$(ADAPTIVE_METHODS)" $(RESUME)

clean:
	rm -rf $(VENV) .pytest_cache
