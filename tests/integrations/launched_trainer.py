"""A training script that knows nothing of hf-precision, run by tests/integrations/test_launcher.py
under ``hf-precision run`` / ``HF_PRECISION_GUARD`` (alone, or on every rank of a torchrun job).

    python launched_trainer.py OUT_DIR

It trains a tiny LLaVA (vision tower loaded in fp16 and frozen, the rest fp32) two steps with a
plain ``transformers.Trainer`` and writes ``OUT_DIR/rank<r>.json``: the Trainer's callbacks, the
guard's events and policy, the dtypes per group after training.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")
torch.set_num_threads(1)


class Rows(torch.utils.data.Dataset):
    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch, self.n = batch, next(iter(batch.values())).shape[0]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def main(out: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from hf_precision import dtype_map
    from hf_precision.tiny import tiny_batch, tiny_llava

    model = tiny_llava(seed=0)
    model.model.vision_tower.to(torch.float16).requires_grad_(False)
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=2,
        save_strategy="no",
        remove_unused_columns=False,
        disable_tqdm=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Rows(tiny_batch(model, 4)))
    trainer.train()
    guards = [c for c in trainer.callback_handler.callbacks if hasattr(c, "guard")]
    rank = trainer.args.process_index
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "world_size": trainer.args.world_size,
                "callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks],
                "events": [list(e) for g in guards for e in g.events],
                "policy": [g.policy.name for g in guards],
                "groups": {g: sorted(s.dtypes) for g, s in dtype_map(model).groups.items()},
                "tool": os.environ.get("HF_PRECISION_TOOL"),
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
