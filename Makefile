# shardc: two commands on a fresh machine.
#   make demo   set up the virtualenv and compile the bundled example
#   make test   set up the virtualenv and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 is asked for by version so pip takes the on-disk CPU wheel
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,sb3]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/shardc compile examples/mixtral_8x7b.py --mesh 8x128 --budget 4000 --seed 0 --out shardc_out/mixtral_8x7b

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

lint: $(STAMP)
	$(BIN)/ruff check shardc tests examples benchmarks

clean:
	rm -rf $(VENV) shardc_out .pytest_cache
