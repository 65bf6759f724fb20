"""Shared fixtures: offline environment, tiny models and a real Trainer factory."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-test` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class ListDataset(torch.utils.data.Dataset):
    """Rows of a batch dict as a map-style dataset (Trainer needs ``__len__``)."""

    def __init__(self, batch: dict[str, torch.Tensor], repeat: int = 1) -> None:
        n = next(iter(batch.values())).shape[0]
        self.rows = [{k: v[i] for k, v in batch.items()} for _ in range(repeat) for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


@pytest.fixture(autouse=True)
def _no_leaked_mixed_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 4.x's ``TrainingArguments(bf16=True)`` exports ACCELERATE_MIXED_PRECISION,
    which every later ``Accelerator()`` in the process would read: each test starts without."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)


class Said(logging.Handler):
    """What the ``hf_precision`` logger said (the console channel of every finding)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def about(self, words: str) -> list[str]:
        return [line for line in self.lines if words in line]


@pytest.fixture
def said() -> Any:
    """The ``hf_precision`` logger's lines during the test (INFO and above), whatever the
    warning filters: ``said.about("updates lost")``."""
    logger = logging.getLogger("hf_precision")
    handler, level = Said(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def list_dataset() -> type[ListDataset]:
    """The dataset class of :func:`make_trainer`, for tests that build their own Trainer."""
    return ListDataset


@pytest.fixture
def tiny_args(tmp_path: Any) -> Callable[..., Any]:
    """``tiny_args(**overrides) -> TrainingArguments`` for the tiny models: CPU, two steps of
    batch 2, output in ``tmp_path/out``, no checkpoints, no trackers, no worker processes."""
    from transformers import TrainingArguments

    def factory(**overrides: Any) -> Any:
        defaults: dict[str, Any] = dict(
            output_dir=str(tmp_path / "out"),
            use_cpu=True,
            report_to=[],
            max_steps=2,
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            save_strategy="no",
            remove_unused_columns=False,
            disable_tqdm=True,
            dataloader_num_workers=0,
            learning_rate=1e-3,
            seed=0,
        )
        return TrainingArguments(**{**defaults, **overrides})

    return factory


@pytest.fixture
def make_trainer(tiny_args: Callable[..., Any]) -> Callable[..., Any]:
    """``make_trainer(model, batch, callbacks=[...], **training_args) -> Trainer`` on CPU."""
    from transformers import Trainer

    def factory(
        model: torch.nn.Module,
        batch: dict[str, torch.Tensor],
        *,
        callbacks: list[Any] | None = None,
        repeat: int = 2,
        **kw: Any,
    ) -> Any:
        args = tiny_args(**{"logging_steps": 1, **kw})
        data = ListDataset(batch, repeat)
        return Trainer(
            model=model, args=args, train_dataset=data, eval_dataset=data, callbacks=callbacks or []
        )

    return factory


@pytest.fixture
def lora_llama() -> Callable[..., Any]:
    """``lora_llama(dtype=torch.bfloat16)``: a one-layer Llama (vocabulary 64, 32 wide) in
    ``dtype`` with LoRA (r=4) on ``q_proj``/``v_proj``, the adapters as after some training
    (``init_lora_weights=False``) and fp32 (PEFT's ``autocast_adapter_dtype``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(dtype: torch.dtype = torch.bfloat16) -> Any:
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        torch.manual_seed(0)
        base = LlamaForCausalLM(config).to(dtype)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return get_peft_model(base, lora)

    return build


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The real ``Trainer`` patched as the launcher's import hook patches it, with
    ``HF_PRECISION_GUARD=auto`` and no other launcher variable set; yields ``monkeypatch`` (to
    set more). Afterwards the patch is off and ``Trainer.__init__``'s signature is as before."""
    import inspect

    from transformers import Trainer

    from hf_precision.integrations import launch_config, launcher

    before = inspect.signature(Trainer.__init__)
    for var in launch_config.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_PRECISION_GUARD", "auto")
    assert launcher.patch_trainer(Trainer)
    yield monkeypatch
    assert launcher.unpatch_trainer(Trainer)
    assert inspect.signature(Trainer.__init__) == before


@pytest.fixture
def fresh_accelerate() -> Any:
    """AcceleratorState is a process-wide singleton: a test that uses it gets its own (a module
    asks for it with ``pytestmark = pytest.mark.usefixtures("fresh_accelerate")``)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def hub_404() -> Any:
    """A Hub endpoint that answers, and knows no repository (as huggingface.co answers an
    unknown id): a local HTTP server on a free port."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("X-Error-Message", "Repository not found")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
