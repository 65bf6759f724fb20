"""The engine every front end runs: one walk of the model per event, the pipeline's steps in
order, adapters holding no logic of their own."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionError, PrecisionGuardCallback, PrecisionPolicy, PrecisionWarning
from hf_precision.engine import enforce
from hf_precision.engine import guard as guard_module
from hf_precision.engine.guard import PrecisionGuard
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.tiny import tiny_batch, tiny_llava

PKG = str(Path(__file__).resolve().parents[2] / "hf_precision")


def _load_walks() -> Any:
    """``tests/multiprocess/walks.py``: the counter this file and the two-rank scenario share."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "multiprocess" / "walks.py"
    spec = importlib.util.spec_from_file_location("hf_precision_tests_walks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


counting_walks = _load_walks().counting_walks
#: one event: the view's walk, its one unwrap and its one model check; nothing else
ONE_WALK = ["view.py:walk_modules"]
ONE_UNWRAP = ["view.py:of"]
ONE_CHECK = ["view.py:of"]


def _split() -> nn.Module:
    model = tiny_llava(torch.bfloat16)
    model.model.vision_tower.float()
    return model


@pytest.mark.parametrize(
    ("drift", "keep"),
    [(False, ()), (True, ()), (False, ("vison_tower",))],
    ids=["clean", "drift", "typo"],
)
def test_one_walk_of_the_model_per_event(
    drift: bool, keep: tuple[str, ...], tmp_path: Path
) -> None:
    """One event walks the model once (no subtree walk, no ``_modules`` stack walk), unwraps it
    once and checks it once: the plan (its "did you mean" for a keep_fp32 pattern that selects
    nothing included), the apply, the guards (each group's receiving dtype and device, its
    entry leaf), the dtype map and the rank check all read the event's view."""
    model = _split()
    policy = PrecisionPolicy.from_preset("bf16-true", keep_fp32=keep)
    guard = PrecisionGuard(model, policy, reporter=PrecisionReporter(tmp_path))
    with counting_walks(model) as setup:
        guard.verify("setup")  # the first event: its memory account reads the view too
    assert (setup.walks, setup.unwraps, setup.checks) == (ONE_WALK, ONE_UNWRAP, ONE_CHECK)
    if drift:
        model.model.multi_modal_projector.float()
    plans: list[int] = []
    plan = guard_module.plan_policy

    def counted(*args: Any, **kwargs: Any) -> Any:
        plans.append(1)
        return plan(*args, **kwargs)

    with counting_walks(model) as seen, pytest.MonkeyPatch.context() as mp:
        mp.setattr(guard_module, "plan_policy", counted)
        report = guard.verify("check", check_ranks=True)  # plan, apply, guards, map, files
    assert seen.walks == ONE_WALK  # the event's ModelView, nothing else
    assert (seen.unwraps, seen.checks) == (ONE_UNWRAP, ONE_CHECK)
    assert len(plans) == 1  # the audit's plan is the one applied, not planned again
    assert bool(report.changes) == drift
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert guard.handle is not None and guard.handle.boundary  # the guards were put


def test_the_counter_sees_subtree_and_stack_walks() -> None:
    """The counter can fail: a walk of one group, a ``children()`` pass and the dtype map's own
    ``_modules`` stack walk (no view given) are each seen, named after who started them."""
    from hf_precision.engine.hooks import install_guards
    from hf_precision.model.dtype_maps import dtype_map

    model = _split()
    with counting_walks(model) as seen:
        install_guards(model, "bf16-true")  # no view: builds one (a walk, an unwrap, a check)
        dtype_map(model)  # no view: its own stack walk over _modules
        model.model.vision_tower.parameters()  # the test's own walks are not counted
    assert seen.walks == ["view.py:walk_modules", "module_records.py:walk"]
    assert seen.unwraps[0] == "view.py:reuse" and "dtype_maps.py:_dtype_map" in seen.unwraps
    assert seen.checks[0] == "view.py:reuse" and "dtype_maps.py:dtype_map" in seen.checks
    with counting_walks(model) as seen:
        from hf_precision.model.view import receiving

        receiving(model.model.vision_tower)  # a walk of one group's subtree
        list(model.children())  # the test's own pass: not hf-precision's
    assert seen.walks == ["view.py:receiving"]


def test_a_front_end_that_asks_holds_first_unwraps_once(tmp_path: Path) -> None:
    model = _split()
    guard = PrecisionGuard(model, PrecisionPolicy.from_preset("bf16-true"))
    guard.verify("setup")
    with counting_walks(model) as seen:
        assert guard.holds(model)
        guard.verify("check", model=model)
    assert seen.walks == ONE_WALK and seen.checks == ONE_CHECK
    assert seen.unwraps == ["guard.py:holds"]
    assert not guard.holds(tiny_llava())  # another model: not this guard's


def test_a_callback_evaluation_walks_the_model_once(make_trainer: Any) -> None:
    model = _split()
    trainer = make_trainer(model, tiny_batch(model), callbacks=[PrecisionGuardCallback()])
    with counting_walks(model) as seen:
        trainer.evaluate()  # on_evaluate: one event
    assert seen.walks == ONE_WALK
    assert seen.checks == ONE_CHECK
    # the callback asks guard.holds(model), whose unwrap the event then reuses: one in all
    assert seen.unwraps == ["guard.py:holds"]


def test_events_run_the_pipeline_in_order(tmp_path: Path) -> None:
    model = _split()
    guard = PrecisionGuard(
        model, PrecisionPolicy.from_preset("bf16-true"), reporter=PrecisionReporter(tmp_path)
    )
    first = guard.verify("setup")
    assert first.applied and first.changes and guard.handle is not None
    assert guard.handle.count > 0 and not guard.drifted()
    model.model.vision_tower.float()  # drift after setup: repaired and said
    assert guard.drifted()
    with pytest.warns(PrecisionWarning, match=r"PrecisionGuard\.again: dtype drift repaired"):
        again = guard.verify("again")
    assert again.changes and not guard.drifted()
    assert guard.events == [("setup", len(first.changes)), ("again", len(again.changes))]
    written = sorted(p.name for p in tmp_path.glob("*.json"))
    assert written == ["000000-again.json", "000000-setup.json"]
    guard.teardown()
    assert guard.handle is not None and all(
        "_hf_precision_guard" not in m.__dict__ for m in model.modules()
    )


def test_front_ends_hold_no_pipeline_of_their_own() -> None:
    """The adapters call the engine: none of them plans, casts or installs guards itself."""
    for name in ("frontends/callback.py", "frontends/accelerate_plugin.py"):
        source = (Path(PKG) / name).read_text()
        for call in ("enforce_policy(", "install_guards(", "check_model_ranks(", ".data ="):
            assert call not in source, (name, call)


def test_a_guard_whose_first_event_fails_releases_the_model() -> None:
    model = _split()
    model.model.vision_tower.to("meta")  # never materialised: the first event raises
    failed = PrecisionGuard(model, PrecisionPolicy.from_preset("bf16", mode="fix"))
    with pytest.raises(PrecisionError, match="meta device"):
        failed.verify("setup")
    assert failed.handle is None and not failed.events
    model.model.vision_tower.to_empty(device="cpu")
    # the failed guard is still referenced here, yet a guard with another policy may take over
    other = PrecisionGuard(model, PrecisionPolicy.from_preset("bf16-true"))
    other.verify("setup")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # a guard that did guard keeps its claim: a third with another policy is refused, and the
    # error names the fields the two policies differ in even when their summaries read the same
    with pytest.raises(PrecisionError, match=r"they differ in mode='fix' vs 'audit'"):
        PrecisionGuard(model, PrecisionPolicy.from_preset("bf16-true", mode="audit"))


def test_full_eval_stash_gives_back_what_the_plan_kept_in_fp32() -> None:
    """``*_full_eval`` rounds the whole model in place: the deliberate fp32 norms and the
    model's ``_keep_in_fp32_modules_strict`` come back exactly, as trainable weights do."""
    model = tiny_llava(torch.bfloat16)
    norm = model.model.language_model.norm
    norm.weight.data = norm.weight.data.float() + 0.001  # upcast_layernorm, not bf16-exact
    model._keep_in_fp32_modules_strict = ["multi_modal_projector.linear_2"]
    model.model.multi_modal_projector.linear_2.float()
    for p in model.parameters():
        p.requires_grad = False
    exact = norm.weight.detach().clone()
    guard = PrecisionGuard(model, PrecisionPolicy.from_preset("bf16"), claim=False)
    guard.verify("setup")
    rules = {n: r for n, _, r, _ in guard.last_report.kept}
    assert rules["model.language_model.norm.weight"] == "deliberate_fp32"
    assert rules["model.multi_modal_projector.linear_2.weight"] == "keep_fp32_strict"
    guard.stash(torch.bfloat16, limit_bytes=2**30)
    model.to(torch.bfloat16)  # what Trainer.evaluate does under bf16_full_eval
    assert guard.restore() >= 3
    assert norm.weight.dtype == torch.float32 and torch.equal(norm.weight, exact)
    assert model.model.multi_modal_projector.linear_2.weight.dtype == torch.float32


# ---------------------------------------------------------------------- in the user's words


def test_the_cast_line_without_a_reporter_says_report_off(caplog: Any) -> None:
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    guard = PrecisionGuard(
        model, PrecisionPolicy.from_preset("fp32"), origin="as given: PrecisionGuard('fp32')"
    )
    with caplog.at_level("WARNING", logger="hf_precision"):
        guard.verify("setup")
    line, memory, account = [r.getMessage() for r in caplog.records if r.name == "hf_precision"]
    assert memory.startswith("hf-precision: upcast weights take more memory: vision_encoder")
    assert account.startswith("hf-precision: memory: trainable upcast ")
    n = sum(1 for _ in model.model.vision_tower.parameters())
    assert line.startswith(
        f"hf-precision: {n} tensors → float32 (trainable) in vision_encoder (e.g."
    )
    assert line.endswith("), as given: PrecisionGuard('fp32'); report: off (report=False)")
    guard.teardown()


def test_memory_line_counts_only_upcast_weights() -> None:
    from hf_precision.base.tables import fmt_bytes
    from hf_precision.engine.lines import memory_line

    model = tiny_llava(torch.bfloat16)
    report = enforce.enforce_policy(model, PrecisionPolicy.from_preset("fp32"), mode="audit")
    line = memory_line(report)
    numel = {g: 0 for g in ("vision_encoder", "projector", "language_model", "lm_head")}
    for name, p in model.named_parameters():
        numel[report.groups.group_of(name)] += p.numel()
    assert line is not None and line.startswith("hf-precision: upcast weights take more memory: ")
    for group, n in numel.items():
        assert f"{group} {fmt_bytes(2 * n)} → {fmt_bytes(4 * n)}" in line
    assert memory_line(enforce.enforce_policy(tiny_llava(), "bf16-true", mode="audit")) is None


def test_a_renamed_group_in_the_policy_still_reaches_its_modules() -> None:
    from hf_precision.tiny import tiny_qwen2_vl

    model = tiny_qwen2_vl().requires_grad_(False)  # group_dtypes is for frozen weights
    policy = PrecisionPolicy.from_preset("fp32", group_dtypes={"resampler": "bf16"})
    guard = PrecisionGuard(model, policy, call="PrecisionGuardCallback(policy)")
    with pytest.warns(
        PrecisionWarning,
        match=r"PrecisionGuardCallback\(policy\): under rule 'qwen2_vl' .*'resampler' is "
        r"'projector' now .*Fix: name 'projector' in group_dtypes",
    ):
        guard.verify("setup")
    assert {p.dtype for p in model.model.visual.merger.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.model.visual.blocks.parameters()} == {torch.float32}
    assert guard.policy is policy  # the user's policy is not changed
    guard.teardown()


def test_flag_conflict() -> None:
    from hf_precision.engine.lines import flag_conflict
    from hf_precision.rules import flags

    def check(preset: str, flag: str | None) -> Any:
        return flag_conflict(
            PrecisionPolicy.from_preset(preset),
            flag,
            call=f"G({preset!r})",
            said=flags.flag(flag or "bf16", tool="llamafactory"),
            runner="the Trainer",
            owner="G",
            words=lambda n, v: flags.flag(n, v, tool="llamafactory"),
        )

    assert check("fp16", None) is None and check("bf16", "bf16") is None
    assert check("bf16-true", "bf16") is None and check("fp16", "fp16") is None
    err = check("fp16", "bf16")
    assert isinstance(err, PrecisionError)
    assert str(err).startswith("G('fp16') with bf16: true: the Trainer autocasts to bfloat16")
    assert "Fix: G() (it follows bf16: true), or G('bf16'), or train in float16: fp16: true" in (
        str(err)
    )
    assert isinstance(check("bf16", "fp16"), PrecisionError)
    warn = check("fp32", "bf16")
    assert isinstance(warn, str) and "it runs" in warn and "bf16: false" in warn


def test_the_cast_line_says_what_was_kept_in_float32_on_purpose(caplog: Any) -> None:
    """upcast_layernorm's fp32 norms among bf16 weights are kept and said with their rule;
    every model's rotary tables are kept too, in the report only (not console noise)."""
    model = tiny_llava(torch.bfloat16)
    model.model.multi_modal_projector.to(torch.float16)  # something to cast
    model.requires_grad_(False)  # frozen: what upcast_layernorm chose, not what the optimizer needs
    norms = [
        m.weight for m in model.model.language_model.modules() if type(m).__name__.endswith("Norm")
    ]
    for w in norms:
        w.data = w.data.float()
    guard = PrecisionGuard(model, PrecisionPolicy.from_preset("bf16-true"), origin="as given")
    with caplog.at_level("WARNING", logger="hf_precision"):
        guard.verify("setup")
    line, account = [r.getMessage() for r in caplog.records if r.name == "hf_precision"]
    assert f"; kept in float32 on purpose: {len(norms)} (deliberate_fp32); policy " in line
    assert f"kept float32 (deliberate_fp32) {len(norms)} +" in account
    assert "(rotary)" not in account
    assert "(rotary)" not in line  # the recomputed tables are a cast, said as one
    assert {w.dtype for w in norms} == {torch.float32}
    assert any(rule == "rotary" for _, _, rule, _ in guard.last_report.kept)
    guard.teardown()


def test_one_dtype_map_per_event_shared_by_the_reporter_and_the_rank_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_precision.engine.wrappers import ranks as distributed
    from hf_precision.model import dtype_maps

    model = _split()
    reporter = PrecisionReporter(tmp_path)
    guard = PrecisionGuard(model, PrecisionPolicy.from_preset("bf16-true"), reporter=reporter)
    guard.verify("setup")
    maps: list[Any] = []
    compared: list[Any] = []
    build = dtype_maps._dtype_map

    def counted(*args: Any, **kwargs: Any) -> Any:
        maps.append(build(*args, **kwargs))
        return maps[-1]

    monkeypatch.setattr(dtype_maps, "_dtype_map", counted)
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)  # the rank check runs
    monkeypatch.setattr(distributed, "check_ranks_agree", lambda m, **kw: compared.append(m))
    guard.verify("check", check_ranks=True)
    assert len(maps) == 1 and compared == maps and reporter.last_map is maps[0]
    guard.teardown()


def test_configure_is_the_one_way_a_front_end_changes_the_engine(tmp_path: Path) -> None:
    """#29: a front end tells the engine what it learnt (a restored policy, its reporter, the
    DeepSpeed dtype) through one method that names its fields, not by writing them."""
    guard = PrecisionGuard(tiny_llava(), PrecisionPolicy.from_preset("fp32"), name="Front")
    reporter = PrecisionReporter(tmp_path)
    bf16 = PrecisionPolicy.from_preset("bf16")
    guard.configure(
        policy=bf16,
        reporter=reporter,
        deepspeed_dtype=torch.bfloat16,
        deepspeed_stage=3,
        origin="from Accelerator(mixed_precision='bf16')",
    )
    assert guard.policy is bf16 and guard.reporter is reporter
    assert (guard.deepspeed_dtype, guard.deepspeed_stage) == (torch.bfloat16, 3)
    assert guard.origin == "from Accelerator(mixed_precision='bf16')"
    with pytest.raises(TypeError, match=r"Front.configure\(reporterr=...\): no such field"):
        guard.configure(reporterr=reporter)
    with pytest.raises(TypeError, match="deepspeed_stage='3'.*expected int or NoneType"):
        guard.configure(deepspeed_stage="3")
    with pytest.raises(TypeError, match="policy='bf16'.*expected PrecisionPolicy"):
        guard.configure(policy="bf16")
    assert guard.policy is bf16 and guard.deepspeed_stage == 3  # a refused call changes nothing
    guard.teardown()


ENGINE_FIELDS = {
    "policy",
    "reporter",
    "deepspeed_dtype",
    "deepspeed_stage",
    "origin",
    "model",
    "root",
    "groups",
    "handle",
    "last_report",
    "events",
    "params",
    "dtypes",
    "wrap_dtypes",
    "sections",
}


def test_no_front_end_writes_the_engines_fields() -> None:
    """#29: "the plugin writes the engine's fields before each event". Outside the engine, an
    assignment to an engine field of anything but ``self`` (``g.policy = ...``,
    ``other.reporter = ...``) is refused: front ends call :meth:`PrecisionGuard.configure`."""
    import ast

    found = []
    for folder in ("frontends", "integrations", "tools"):
        for path in sorted(Path(PKG, folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = node.targets if isinstance(node, ast.Assign) else []
                for t in targets:
                    for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if (
                            isinstance(el, ast.Attribute)
                            and el.attr in ENGINE_FIELDS
                            and not (isinstance(el.value, ast.Name) and el.value.id == "self")
                            and ast.unparse(el) != "plugin.reporter"  # the plugin's own property
                        ):
                            found.append(f"{folder}/{path.name}:{el.lineno} {ast.unparse(el)}")
    assert found == []
