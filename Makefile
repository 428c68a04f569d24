# The two commands of the README. Both create .venv (Python 3.11+) and install the project from this checkout.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mm-oval-installed

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch and torchvision as a matched pair first (open_clip needs torchvision; never newer than 2.14.1)
	$(BIN)/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/mm-oval demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(STAMP)
	$(BIN)/ruff check .
	TRITON_INTERPRET=1 $(BIN)/pytest

clean:
	rm -rf $(VENV) build *.egg-info
