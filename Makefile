# make run   - set up .venv and generate from the embedded default model
# make test  - set up .venv and run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP := scripts/setup_venv.sh
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
# `make run`'s request: the format the embedded model was chat-tuned on, sampled with the
# settings that gave its most Python-like answers of those tried (README, "The embedded model");
# seed 0 makes the answer repeatable. Override: make run CHAT='...' SAMPLING='...'
CHAT ?= Write a Python function `def is_even(n)` that does this: Return True if n is even.
SAMPLING ?= --temperature 1.0 --min-p 0.2 --seed 0 --max-tokens 96

.PHONY: run test serve bench lint format clean

# set-up: one progress line per step, pip's output in $(VENV)/setup.log
$(RUN_STAMP): pyproject.toml $(SETUP)
	@bash $(SETUP) $(VENV) run
	@touch $@

$(STAMP): pyproject.toml $(SETUP)
	@bash $(SETUP) $(VENV) test
	@touch $@ $(RUN_STAMP)

run: $(RUN_STAMP)
	@$(VENV)/bin/expresslane run --chat '$(CHAT)' $(SAMPLING)

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
