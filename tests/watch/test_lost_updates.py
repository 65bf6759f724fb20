"""The lost-update check: a real full fine-tune of a bf16-loaded tiny LLaVA with a real Trainer
and AdamW at lr 1e-5 loses most updates, measured on the optimizer's own step hooks; an fp32
control run loses none and says nothing. Also runs the python blocks of
docs/updates_memory_provenance.md."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from hf_precision import PrecisionError, PrecisionGuardCallback, PrecisionWarning
from hf_precision.tiny import tiny_batch, tiny_llava
from hf_precision.watch.lost_updates import LostUpdateCheck, lost_updates_fix

DOC = Path(__file__).resolve().parents[2] / "docs" / "updates_memory_provenance.md"


def _train(
    make_trainer, said, dtype: torch.dtype, report_to: list[str] | None = None, **cb: object
):
    model = tiny_llava(seed=0).to(dtype)  # every weight trainable: a full fine-tune
    callback = PrecisionGuardCallback(**cb)  # no flag: the no-flag rule keeps bf16 trainables
    trainer = make_trainer(
        model,
        tiny_batch(model, 2),
        callbacks=[callback],
        learning_rate=1e-5,
        max_steps=3,
        report_to=report_to or [],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")  # as many scripts and notebooks do
        trainer.train()
    return trainer, callback, model, said.about("updates lost")


def _section(trainer) -> dict:
    [path] = sorted((Path(trainer.args.output_dir) / "precision").glob("*-lost_updates.json"))
    return json.loads(path.read_text())["lost_updates"]


def test_a_bf16_full_fine_tune_is_warned_with_its_measured_share(
    make_trainer, said, tmp_path, monkeypatch
):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    try:
        trainer, callback, model, lost = _train(make_trainer, said, torch.bfloat16, ["wandb"])
        summary = dict(wandb.run.summary)
    finally:
        wandb.finish()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # trained as loaded
    [line] = lost  # on the console through logging, under warnings.filterwarnings("ignore")
    section = _section(trainer)
    assert section["steps"] == 3 and section["half_share"] > 0.5, section
    assert summary["precision/lost_updates/half_share"] == section["half_share"]  # W&B
    assert summary["precision/lost_updates/message"] == line
    _the_finding_is_reported(trainer, line, section)
    assert section["counted"] > 1000
    share = re.search(r"(\d+)% of the sampled bfloat16 elements", line)
    assert share and int(share.group(1)) == round(100 * section["half_share"])
    named = [w for w in section["weights"] if w["share"] > 0.1]
    assert named[0]["dtype"] == "bfloat16"
    assert "model.language_model" in line or "model.vision_tower" in line
    assert f"in {len(named)} trainable weight(s)" in line
    assert "bf16=True" in line  # the fix in the user's tool's words (Python here)
    half = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert section["fp32_cost_bytes"] == {"weights": 2 * half, "with_grads_and_adamw": 8 * half}
    # the hooks are off after the third step
    assert callback.step_watch.lost is not None and not callback.step_watch.lost.active


def _the_finding_is_reported(trainer, line: str, section: dict) -> None:
    """The finding in words in precision.log, in its event JSON (and the findings of later
    events), and its picture draws the unchanged share per group, not the dtype chart."""
    from hf_precision.report.plot import plot_finding
    from hf_precision.watch.finding import Finding

    folder = Path(trainer.args.output_dir) / "precision"
    assert line in (folder / "precision.log").read_text()
    [path] = sorted(folder.glob("*-lost_updates.json"))
    found = json.loads(path.read_text())["finding"]
    assert found["severity"] == "warning" and found["message"] == line
    assert found["numbers"] == section
    groups = found["groups"]
    assert set(groups) >= {"vision_encoder", "language_model"} and max(groups.values()) > 0.5
    png = path.with_suffix(".png").read_bytes()
    title = f"lost_updates, step {json.loads(path.read_text())['step']}"
    assert png == plot_finding(Finding(**found), title=title)  # the finding, drawn
    later = sorted(folder.glob("*-on_train_end*.json")) or sorted(folder.glob("*.json"))[-1:]
    assert any(f["source"] == "lost_updates" for f in json.loads(later[-1].read_text())["findings"])


def test_an_fp32_control_run_loses_nothing_and_says_nothing(make_trainer, said):
    trainer, _, _, lost = _train(make_trainer, said, torch.float32)
    assert lost == []
    [line] = said.about("update check passed")  # what was measured, said at INFO
    assert line in (Path(trainer.args.output_dir) / "precision" / "precision.log").read_text()
    section = _section(trainer)
    assert section["counted"] > 1000 and section["share"] < 0.01, section
    assert section["half_share"] == 0.0 and section["fp32_cost_bytes"]["weights"] == 0


def test_off_watches_nothing(make_trainer, said):
    trainer, callback, _, lost = _train(make_trainer, said, torch.bfloat16, lost_updates="off")
    assert lost == [] and callback.step_watch.lost is None
    assert not list((Path(trainer.args.output_dir) / "precision").glob("*-lost_updates.json"))
    with pytest.raises(PrecisionError, match="lost_updates='maybe'"):
        PrecisionGuardCallback(lost_updates="maybe")  # type: ignore[arg-type]


def test_zero_gradients_are_not_counted_and_no_copy_is_made():
    w = torch.nn.Parameter(torch.ones(10_000, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([w], lr=1e-2, weight_decay=0.0)
    check = LostUpdateCheck({"w": w}, steps=2, sample=256).attach(opt)
    for _ in range(2):
        w.grad = torch.zeros_like(w)
        w.grad[:5000] = 1.0  # half the rows get a gradient, the rest are unused rows
        opt.step()
    [tally] = check.result().weights
    assert 0 < tally.counted < 2 * 256  # only the sampled elements with a gradient
    assert tally.unchanged == 0  # lr 1e-2 moves a bf16 1.0 (spacing 2**-7)
    assert check._before == {} and not check.active


def test_the_fix_names_the_flag_of_the_users_tool(tiny_args):
    assert "bf16=True" in lost_updates_fix(None)
    assert "TrainingArguments(bf16=True)" in lost_updates_fix(tiny_args())


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.parametrize("i", range(3))
def test_the_docs_python_blocks_run(i, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks()
    assert len(blocks) == 3
    exec(compile(blocks[i], f"{DOC.name}[{i}]", "exec"), {"__name__": "__doc_example__"})


def test_a_check_that_fails_warns_once_and_the_step_goes_on():
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = torch.optim.SGD([w], lr=1.0)
    check = LostUpdateCheck({"w": w}, steps=3).attach(opt)
    check._index["w"] = torch.tensor([100])  # out of range: the snapshot raises IndexError
    w.grad = torch.ones_like(w)
    with pytest.warns(PrecisionWarning, match="the lost-update check stopped .IndexError"):
        opt.step()
    assert torch.equal(w.detach(), torch.zeros(8, dtype=torch.bfloat16))  # the step ran
    assert not check.active and check.seen == 0
