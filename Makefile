# hf-precision: `make demo` and `make test` work from a fresh clone (they set up .venv first).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo demo-setup test test-fast test-tf4 test-frameworks frameworks-setup test-diffusers test-onetrainer onetrainer-setup test-kohya kohya-setup lint typecheck bench gpu-test nightly clean notebooks

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
	# the editable install carries the start-up line too (setup.py): HF_PRECISION_GUARD works here;
	# the tests that need a Python without it make one (`python -S`)
	touch $@

setup: $(VENV)/.installed

# The demo's own venv: the package with the wandb and recipes extras only (no DeepSpeed,
# bitsandbytes, torchao, mypy...: nothing that prints at import), the tested versions.
DEMO_VENV ?= .venv-demo
DEMO_BIN := $(DEMO_VENV)/bin

$(DEMO_VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(DEMO_VENV)
	$(DEMO_BIN)/python -m pip install -q --upgrade pip
	$(DEMO_BIN)/python -m pip install -q "torch==2.13.0"
	$(DEMO_BIN)/python -m pip install -q -c constraints.txt "torch==2.13.0" -e ".[wandb,recipes]"
	# the editable install carries the start-up line HF_PRECISION_GUARD=... needs (setup.py)
	touch $@

demo-setup: $(DEMO_VENV)/.installed

# Execute the demo notebooks and store them with their outputs (tests/test_notebooks.py fails
# when the stored outputs are stale).
notebooks: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python notebooks/_build.py

# LoRA on a tiny split LLaVA with the guard, in the demo's venv (README: "Try it")
# (WANDB_MODE unset: without a W&B login the recipe logs offline and says so in its one line;
# one thread: a tiny model gains nothing from more, and spinning threads cost CPU)
demo: demo-setup
	env -u WANDB_MODE OMP_NUM_THREADS=1 $(DEMO_BIN)/python recipes/lora_llava.py --config recipes/configs/llava/tiny.yaml \
		--report_to wandb

test: setup
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -m "not frameworks and not diffusers and not onetrainer and not kohya"

# The transformers 4.x leg: its own venv (.venv-tf4) with the 4.57 line and the peft that goes
# with it; the core, scenario and seed-layout tests run there (see the README's compatibility
# table), and tests/tiny/test_matrix.py checks docs/matrix.md's 4.57 column (in tests/tiny). The
# 5.x leg is `make test`.
TF4_VENV ?= .venv-tf4
TF4_PINS ?= "transformers==4.57.6" "peft==0.17.1"
TF4_TESTS ?= tests/engine/test_enforce.py tests/engine/test_plan.py tests/rules/groups/test_module_groups.py tests/model/test_view.py \
	tests/engine/test_guard.py tests/engine/test_hooks.py tests/engine/test_batch.py \
	tests/rules/policy/test_precision_policy.py tests/model/test_dtype_maps.py tests/rules/test_dtypes.py tests/frontends/test_callback.py \
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
	$(BIN)/python -m pytest -q -x -m "not slow and not multiprocess and not frameworks and not diffusers and not onetrainer and not kohya"

# The framework leg: each framework's real command line on a tiny VLM LoRA job, in its own venv
# (a framework pins its own transformers/peft/trl). torch is the CPU wheel, pinned on every pip
# line (an unpinned torch, or a torchvision resolved alone, pulls a multi-GB CUDA build).
# LLaMA-Factory pulls torchvision/torchaudio, whose PyPI wheels are CUDA builds: their compiled
# ops cannot load next to the CPU torch (`operator torchvision::nms does not exist`). torchvision
# is removed (LLaMA-Factory does not import it; transformers then uses its PIL image
# processors); torchaudio keeps its Python code without its compiled libraries (its loader
# treats them as not built; LLaMA-Factory only imports it, for audio inputs).
# hf-precision is installed without deps for its `hf-precision` command and start-up hook; the
# tests put this checkout first on PYTHONPATH, so the code under test is this tree's.
LF_VENV ?= .venv-llamafactory
LF_PINS ?= "llamafactory==0.9.5"
SWIFT_VENV ?= .venv-swift
SWIFT_PINS ?= "ms-swift==4.6.0" "transformers==5.19.0" "peft==0.20.0" "trl==0.29.1"

$(LF_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(LF_VENV)
	$(LF_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(LF_VENV)/bin/python -m pip install -q "torch==2.13.0" $(LF_PINS)
	$(LF_VENV)/bin/python -m pip uninstall -q -y torchvision
	rm -f $(LF_VENV)/lib/python*/site-packages/torchaudio/lib/*.so
	$(LF_VENV)/bin/python -m pip install -q --no-deps .
	touch $@

$(SWIFT_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(SWIFT_VENV)
	$(SWIFT_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(SWIFT_VENV)/bin/python -m pip install -q "torch==2.13.0" $(SWIFT_PINS)
	$(SWIFT_VENV)/bin/python -m pip install -q --no-deps .
	touch $@

# axolotl 0.21 declares Python >= 3.12 and pulls CUDA kernels (xformers, triton, liger, fla);
# the torch CPU wheel here is for 3.11, and axolotl's code runs on 3.11: it is installed without
# its deps (--ignore-requires-python), beside its own pins of what `axolotl.cli.train` imports
# for a LoRA job on CPU.
AXOLOTL_VENV ?= .venv-axolotl
AXOLOTL_PIN ?= "axolotl==0.21.0"
AXOLOTL_DEPS ?= "transformers==5.20.1" "peft==0.21.2" "accelerate==1.15.0" "datasets==5.0.1" \
	"trl==1.14.1" "pydantic==2.13.5" "tokenizers==0.23.3" "bitsandbytes==0.50.2" \
	"evaluate==0.4.1" "typer==0.25.1" "axolotl-contribs-lgpl==0.0.7" "axolotl-contribs-mit==0.0.6" \
	addict fire colorama posthog numba einops pyyaml sentencepiece art packaging requests scipy \
	pillow fastcore wandb

$(AXOLOTL_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(AXOLOTL_VENV)
	$(AXOLOTL_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(AXOLOTL_VENV)/bin/python -m pip install -q "torch==2.13.0" $(AXOLOTL_DEPS)
	$(AXOLOTL_VENV)/bin/python -m pip install -q --no-deps --ignore-requires-python $(AXOLOTL_PIN)
	$(AXOLOTL_VENV)/bin/python -m pip install -q --no-deps .
	touch $@

FRAMEWORK_VENVS := $(LF_VENV)/.installed $(SWIFT_VENV)/.installed $(AXOLOTL_VENV)/.installed
frameworks-setup: $(FRAMEWORK_VENVS)

# the tests run this tree (PYTHONPATH); its current start-up line is written into each venv
test-frameworks: setup $(FRAMEWORK_VENVS)
	for v in $(LF_VENV) $(SWIFT_VENV) $(AXOLOTL_VENV); do PYTHONPATH=$(CURDIR) $$v/bin/python -c \
		"from hf_precision.integrations.launch_cli import install_hook; install_hook()" || exit 1; done
	HF_PRECISION_LLAMAFACTORY_VENV=$(abspath $(LF_VENV)) HF_PRECISION_SWIFT_VENV=$(abspath $(SWIFT_VENV)) \
	HF_PRECISION_AXOLOTL_VENV=$(abspath $(AXOLOTL_VENV)) \
		$(BIN)/python -m pytest -n 2 --dist loadgroup -q -m frameworks tests/integrations

# The diffusers leg: diffusers' own example training scripts (vendored unmodified in
# tests/integrations/diffusers_scripts/) under `hf-precision run -- accelerate launch` on a tiny
# pipeline, in the main venv. The scripts import torchvision, whose PyPI wheels are CUDA builds:
# its compiled ops cannot load next to the CPU torch (`operator torchvision::nms does not
# exist`). Its wheel goes, without deps, into a folder of its own (on PYTHONPATH for these tests
# only) without its compiled libraries, and its two fake-kernel registrations run only when the
# ops exist (the scripts use torchvision.transforms only, pure Python).
DIFFUSERS_SITE ?= .venv-diffusers/site
TORCHVISION_PIN ?= "torchvision==0.28.0"

$(DIFFUSERS_SITE)/.installed: | $(BIN)/python
	$(BIN)/python -m pip install -q --no-deps --target $(DIFFUSERS_SITE) $(TORCHVISION_PIN)
	rm -f $(DIFFUSERS_SITE)/torchvision/*.so
	sed -i 's/^@torch\.library\.register_fake(/@(torch.library.register_fake if torchvision.extension._has_ops() else (lambda *a, **k: (lambda f: f)))(/' \
		$(DIFFUSERS_SITE)/torchvision/_meta_registrations.py
	PYTHONPATH=$(DIFFUSERS_SITE) $(BIN)/python -c "from torchvision import transforms"
	touch $@

test-diffusers: setup $(DIFFUSERS_SITE)/.installed
	HF_PRECISION_DIFFUSERS_SITE=$(abspath $(DIFFUSERS_SITE)) \
		$(BIN)/python -m pytest -n 2 --dist loadgroup -q -m diffusers tests/integrations

# The OneTrainer leg: OneTrainer's own scripts/train.py (and mgds) from their snapshots
# (`git archive` tarballs in $(UPSTREAM), unpacked by the tests; AGPL: run, never copied here) on
# a tiny SD 1.5 inpainting model, unguarded and under `hf-precision run`. Two venvs, as
# OneTrainer's requirements of each date pin them: the 2024 code (July 2024, the fp16 failure
# reports) runs on the transformers 4.57 / diffusers 0.30 line, today's on transformers 5.5 /
# diffusers 0.42. open-clip-torch pulls torchvision, whose PyPI wheel is a CUDA build: its
# compiled ops go, as in test-diffusers. xformers, bitsandbytes and the UI are not imported on
# the training path. The tests put this checkout on PYTHONPATH (hf_precision is not installed).
# the first upstream/ folder beside the checkout that holds the snapshots (or set UPSTREAM)
UPSTREAM ?= $(patsubst %/,%,$(dir $(firstword $(wildcard $(abspath ..)/*/upstream/onetrainer-*.tar.gz))))
OT2024_VENV ?= .venv-onetrainer2024
OT2024_PINS ?= "transformers==4.57.6" "accelerate==1.10.1" "diffusers==0.30.3" \
	"huggingface-hub<1.0" "open-clip-torch==2.24.0" pooch
OT_VENV ?= .venv-onetrainer
OT_PINS ?= "transformers==5.5.4" "accelerate==1.12.0" "diffusers==0.42.1" \
	"open-clip-torch==2.32.0" pooch parse gguf av
OT_COMMON ?= "numpy<2.3" opencv-python-headless pillow tqdm pyyaml safetensors scipy omegaconf \
	tensorboard

define ot_venv
	$(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q "torch==2.13.0"
	$(1)/bin/python -m pip install -q "torch==2.13.0" $(OT_COMMON) $(2)
	rm -f $(1)/lib/python*/site-packages/torchvision/*.so
	sed -i 's/^@torch\.library\.register_fake(/@(torch.library.register_fake if torchvision.extension._has_ops() else (lambda *a, **k: (lambda f: f)))(/' \
		$(1)/lib/python*/site-packages/torchvision/_meta_registrations.py
	$(1)/bin/python -c "from torchvision import transforms; import diffusers, cv2, open_clip"
	touch $(1)/.installed
endef

$(OT2024_VENV)/.installed:
	$(call ot_venv,$(OT2024_VENV),$(OT2024_PINS))

$(OT_VENV)/.installed:
	$(call ot_venv,$(OT_VENV),$(OT_PINS))

onetrainer-setup: $(OT2024_VENV)/.installed $(OT_VENV)/.installed

test-onetrainer: setup onetrainer-setup
	HF_PRECISION_UPSTREAM=$(UPSTREAM) HF_PRECISION_ONETRAINER2024_VENV=$(abspath $(OT2024_VENV)) \
	HF_PRECISION_ONETRAINER_VENV=$(abspath $(OT_VENV)) \
		$(BIN)/python -m pytest -q -m onetrainer tests/integrations/test_onetrainer.py
# The kohya leg: kohya-ss sd-scripts' own train_network.py (LoRA) on a tiny SD 1.5, on CPU,
# plain and under `hf-precision run -- accelerate launch` (tests/integrations/test_kohya.py).
# sd-scripts is not on the package index: the tests unpack a snapshot of its source
# ($HF_PRECISION_SD_SCRIPTS, or an upstream/ folder beside the checkout) and skip without one.
# Its venv holds what train_network.py imports on that path, at the versions that run on a CPU:
# transformers 4.57, accelerate 1.10 (the lowest hf-precision accepts), diffusers 0.32.1 and
# huggingface-hub 0.34.3 as sd-scripts pins them, its small requirements (no bitsandbytes or
# optional optimizers: AdamW only), and torchvision's Python without its compiled ops (as in
# test-diffusers). hf-precision itself runs from this checkout (PYTHONPATH), launched by the
# main venv's `python -m hf_precision run`.
KOHYA_VENV ?= .venv-kohya
KOHYA_PINS ?= "transformers==4.57.6" "accelerate==1.10.1" "diffusers==0.32.1" \
	"huggingface-hub==0.34.3" "einops==0.7.0" "opencv-python-headless==4.10.0.84" \
	"toml==0.10.2" "voluptuous==0.15.2" "imagesize==1.4.1" "rich==14.1.0" "ftfy==6.3.1" \
	"numpy<2.3"

$(KOHYA_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(KOHYA_VENV)
	$(KOHYA_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(KOHYA_VENV)/bin/python -m pip install -q "torch==2.13.0" $(KOHYA_PINS)
	$(KOHYA_VENV)/bin/python -m pip install -q --no-deps $(TORCHVISION_PIN)
	rm -f $(KOHYA_VENV)/lib/python*/site-packages/torchvision/*.so
	sed -i 's/^@torch\.library\.register_fake(/@(torch.library.register_fake if torchvision.extension._has_ops() else (lambda *a, **k: (lambda f: f)))(/' \
		$(KOHYA_VENV)/lib/python*/site-packages/torchvision/_meta_registrations.py
	$(KOHYA_VENV)/bin/python -c "from torchvision import transforms; import cv2, diffusers, accelerate"
	touch $@

kohya-setup: $(KOHYA_VENV)/.installed

test-kohya: setup $(KOHYA_VENV)/.installed
	HF_PRECISION_KOHYA_VENV=$(abspath $(KOHYA_VENV)) \
		$(BIN)/python -m pytest -n 2 -q -m kohya tests/integrations/test_kohya.py

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
	rm -rf $(VENV) $(DEMO_VENV) $(TF4_VENV) $(LF_VENV) $(SWIFT_VENV) $(AXOLOTL_VENV) .venv-diffusers $(OT2024_VENV) $(OT_VENV) $(KOHYA_VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
