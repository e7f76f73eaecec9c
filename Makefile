# make demo: fresh machine -> installed -> a local farm answers the bundled sample.
# make test: fresh machine -> installed -> the test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install bench clean

$(BIN)/farm: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(BIN)/farm

demo: install
	$(BIN)/farm run --model lenet --out scores.npy

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python bench/table2.py
	$(BIN)/python bench/scaling.py

clean:
	rm -rf $(VENV) scores.npy
