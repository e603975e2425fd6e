# make run   - set up .venv and generate from the embedded default model
# make test  - set up .venv and run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= def fibonacci(n):

.PHONY: run test serve bench lint format clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch that lies on this machine's disk; a bare `torch` pulls CUDA (GBs)
	$(PY) -m pip install -q torch==2.13.0 || $(PY) -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e '.[test]'
	touch $@

run: $(STAMP)
	$(VENV)/bin/expresslane run --prompt '$(PROMPT)' --max-tokens 96

test: $(STAMP)
	$(PY) -m pytest

serve: $(STAMP)
	$(VENV)/bin/expresslane serve

bench: $(STAMP)
	$(VENV)/bin/expresslane bench --preset llama-tiny --contexts 16 128 --decode-tokens 128 --compile

lint: $(STAMP)
	$(VENV)/bin/ruff check expresslane tests
	$(VENV)/bin/ruff format --check expresslane tests

format: $(STAMP)
	$(VENV)/bin/ruff format expresslane tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
