# Set-up is part of every target: `make test` and `make bench` create .venv and install into it.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel on the development machines; on a GPU machine pass e.g. TORCH="torch==2.11.0".
TORCH ?= torch==2.13.0
DEVICE ?= auto
OPS ?= all
PYTEST_WORKERS ?= 2
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest -n $(PYTEST_WORKERS) -q

# make bench: QUICK=1 for the small grid, SUITES=ops,model to pick suites, OUT=bench/results/cpu to
# update the committed results (default: a new folder under bench/runs/), BENCH_ARGS for the rest.
QUICK ?=
SUITES ?=
OUT ?=
BENCH_ARGS ?=

.PHONY: test test-reference test-triton-interpret test-helion-interpret bench autotune demo doctor clean

$(VENV)/.installed-%: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[$*]"
	@touch $@

# Three tiers, each in its own processes: Helion cannot run with both interpreters set.
test: test-reference test-triton-interpret test-helion-interpret

test-reference: $(VENV)/.installed-test
	$(PYTEST) tests

test-triton-interpret: $(VENV)/.installed-test
	TRITON_INTERPRET=1 $(PYTEST) -m dsl tests

test-helion-interpret: $(VENV)/.installed-test
	HELION_INTERPRET=1 $(PYTEST) -m dsl tests

bench: $(VENV)/.installed-bench
	$(PY) -m bench --device $(DEVICE) $(if $(QUICK),--quick) $(if $(SUITES),--suites $(SUITES)) \
		$(if $(OUT),--out $(OUT)) $(BENCH_ARGS)

demo: $(VENV)/.installed-test
	$(PY) -m hw_agnostic demo $(DEMO_ARGS)

doctor: $(VENV)/.installed-test
	$(PY) -m hw_agnostic doctor

autotune: $(VENV)/.installed-bench
	$(PY) -m hw_agnostic autotune --device $(DEVICE) --ops $(OPS) --out hw_agnostic/autotune_cache

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
