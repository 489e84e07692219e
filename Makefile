# shardc: two commands on a fresh machine.
#   make demo          set up the virtualenv and compile the bundled example
#   make test          set up the virtualenv and run the test suite
# Both install the exact versions of constraints.txt (the set the suite last passed with).
#   make test-latest   the newest releases inside pyproject's ranges (own virtualenv, .venv-latest)
#                      on a fast subset: KV-cache numerics, the support matrix, a compile per frontend
#   make lock          rewrite constraints.txt from .venv (after the suite passed there)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := constraints.txt
LATEST ?= .venv-latest
LATEST_TESTS := tests/test_backend_gloo.py tests/test_physics_gqa_kv_replication.py tests/test_support_matrix.py \
	tests/test_compile.py tests/test_onnx.py tests/test_serving_plan.py tests/test_readme_output.py

.PHONY: setup demo test test-latest lock lint bench clean

$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 is asked for by version so pip takes the on-disk CPU wheel
	$(BIN)/pip install -q -c $(LOCK) "torch==2.13.0"
	$(BIN)/pip install -q -c $(LOCK) -e ".[dev,sb3]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/shardc compile examples/mixtral_8x7b.py --mesh 8x128 --budget 4000 --seed 0 --out shardc_out/mixtral_8x7b

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

# no stamp: every run asks the registry again for the newest releases
test-latest:
	$(PY) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q --upgrade pip
	$(LATEST)/bin/pip install -q "torch==2.13.0"
	$(LATEST)/bin/pip install -q --upgrade --upgrade-strategy eager -e ".[dev,sb3]"
	$(LATEST)/bin/python -m pytest -q -n 2 $(LATEST_TESTS)

lock: $(STAMP)
	{ sed -n '/^#/p' $(LOCK); $(BIN)/pip freeze --exclude-editable | grep -v '^shardc' \
		| sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } > $(LOCK).new && mv $(LOCK).new $(LOCK)

lint: $(STAMP)
	$(BIN)/ruff check shardc tests examples benchmarks

clean:
	rm -rf $(VENV) $(LATEST) shardc_out .pytest_cache
