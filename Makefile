# make demo: fresh machine -> installed -> a local farm answers the bundled sample.
# make check: the fast tier: lint and format (ruff), type check (mypy), in-process tests (tests/unit).
# make test: fresh machine -> installed -> ruff -> mypy beside every test (unit and system).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
comma := ,

.PHONY: demo check test install bench clean

# torch: the CPU build, pinned, unless TORCH says otherwise (TORCH= skips it; the torch
# tests then skip). An unpinned torch pulls the newest release with GBs of CUDA packages.
TORCH ?= torch==2.13.0

$(BIN)/farm: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(if $(TORCH),$(BIN)/pip install --quiet "$(TORCH)")
	$(BIN)/pip install --quiet -e ".[test$(if $(TORCH),$(comma)torch)]"
	-git config core.hooksPath .githooks 2>/dev/null  # commit subjects of 72 characters at most
	touch $@

install: $(BIN)/farm

demo: install
	$(BIN)/farm run --model lenet --repeat 40 --out scores.npy

check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy farm
	$(BIN)/python -m pytest tests/unit

# Two pytest processes, each taking whole test files (a file's farm is started once): most
# tests wait on real processes, so two share even a 2-core machine well (12 min instead
# of 17 on the 2-core AMD EPYC). They take the files in collection order, the longest first
# (tests/system/conftest.py's LONGEST_FILES), so that no long file is left to the end.
# mypy runs beside them; its status counts too.
TEST_PROCESSES ?= 2

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy farm & types=$$!; \
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder; \
	tests=$$?; \
	wait $$types && exit $$tests

# The suite (about an hour here) writes bench/results/DATE-CORES-cpu|gpu/; ray[data] is the
# Ray Data peer's optional dependency.
bench: install
	$(BIN)/pip install --quiet -e ".[bench$(if $(TORCH),$(comma)torch)]"
	$(BIN)/farm bench --out bench/results
	$(BIN)/python bench/table2.py
	$(BIN)/python bench/scaling.py
	$(BIN)/python bench/models.py
	$(BIN)/python bench/soak.py
	$(BIN)/python bench/jobs.py

clean:
	rm -rf $(VENV) scores.npy
