# hf-precision: `make demo` and `make test` work from a fresh clone (they set up .venv first).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-fast test-tf4 lint typecheck bench gpu-test nightly clean notebooks

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q "torch==2.13.0"
	# DS_BUILD_OPS=0: DeepSpeed installs without compiling its CUDA ops (it JIT-builds the one
	# small CPU comm op it needs on first use)
	# constraints.txt: the tested versions of the HF stack (the README's compatibility table)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q -c constraints.txt "torch==2.13.0" -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

# Execute the demo notebooks and store them with their outputs (tests/test_notebooks.py fails
# when the stored outputs are stale).
notebooks: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python notebooks/_build.py

demo: setup
	$(BIN)/python recipes/lora_llava.py --config recipes/configs/llava/tiny.yaml --report_to wandb

test: setup
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

# The transformers 4.x leg: its own venv (.venv-tf4) with the 4.57 line and the peft that goes
# with it; the core, scenario and seed-layout tests run there (see the README's compatibility
# table), and tests/tiny/test_matrix.py checks docs/matrix.md's 4.57 column (in tests/tiny). The
# 5.x leg is `make test`.
TF4_VENV ?= .venv-tf4
TF4_PINS ?= "transformers==4.57.6" "peft==0.17.1"
TF4_TESTS ?= tests/test_enforce.py tests/test_plan.py tests/test_groups.py tests/test_view.py \
	tests/test_guard.py tests/test_hooks.py tests/test_batch.py \
	tests/test_policy.py tests/test_dtype_maps.py tests/test_dtypes.py tests/test_callback.py \
	tests/scenarios tests/tiny tests/test_docs.py::test_compatibility_table_matches_what_runs

$(TF4_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(TF4_VENV)
	$(TF4_VENV)/bin/python -m pip install -q --upgrade pip
	$(TF4_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(TF4_VENV)/bin/python -m pip install -q "torch==2.13.0" $(TF4_PINS) -e ".[wandb,test]"
	touch $@

test-tf4: $(TF4_VENV)/.installed
	$(TF4_VENV)/bin/python -c "import transformers, peft; print('transformers', transformers.__version__, '/ peft', peft.__version__)"
	$(TF4_VENV)/bin/python -m pytest -n 2 --dist loadgroup -q $(TF4_TESTS)

test-fast: setup
	$(BIN)/python -m pytest -q -x -m "not slow and not multiprocess"

lint: setup
	$(BIN)/ruff check hf_precision tests recipes benchmarks
	$(BIN)/ruff format --check hf_precision tests recipes benchmarks

typecheck: setup
	$(BIN)/mypy

bench: setup
	$(BIN)/python -m benchmarks

gpu-test: setup
	$(BIN)/python -m pytest -m gpu -q

nightly: setup
	HF_PRECISION_PROPERTY_EXAMPLES=1000 $(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) $(TF4_VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
