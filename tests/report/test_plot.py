"""The picture of a dtype map: its numbers add up to the map's bytes, it is a PNG of the fixed
size whatever the model, and ``png_size`` refuses what is not a PNG."""

from __future__ import annotations

import doctest
import io
from pathlib import Path

import pytest
import torch

from hf_precision import dtype_map
from hf_precision.report import plot
from hf_precision.report.plot import (
    PICTURE_SIZE,
    group_bytes,
    picture_rows,
    plot_group_bytes,
    plot_precision,
    png_size,
)
from hf_precision.tiny import tiny_llava


def test_the_numbers_behind_the_picture_are_the_maps_bytes() -> None:
    model = tiny_llava()
    model.model.vision_tower.to(torch.bfloat16)
    dmap = dtype_map(model)
    groups, dtypes, table = group_bytes(dmap)
    assert groups == list(dmap.groups) and {"bfloat16", "float32", "int64"} == set(dtypes)
    vision = groups.index("vision_encoder")
    assert table["float32"][vision] == 0 and table["bfloat16"][vision] > 0
    for d in dtypes:
        assert sum(table[d]) == dmap.bytes_by_dtype[d], d


def test_the_picture_is_a_png_of_the_fixed_size_and_written_where_asked(tmp_path: Path) -> None:
    from PIL import Image

    path = tmp_path / "bytes.png"
    png = plot_group_bytes(dtype_map(tiny_llava()), path, title="tiny")
    assert path.read_bytes() == png and png_size(png) == PICTURE_SIZE
    with Image.open(io.BytesIO(png)) as img:
        img.verify()
    small = plot_group_bytes(dtype_map(torch.nn.Linear(2, 2)), size=(320, 200))
    assert png_size(small) == (320, 200)


def test_png_size_refuses_what_is_not_a_png() -> None:
    with pytest.raises(ValueError, match="not a PNG"):
        png_size(b"GIF89a" + bytes(30))


def test_module_doctest() -> None:
    result = doctest.testmod(plot, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


# ---------------------------------------------------------------------------- the report's picture
def _frozen_tower_bf16() -> tuple[torch.nn.Module, object, object]:
    from hf_precision import PrecisionPolicy, enforce_policy

    model = tiny_llava()
    model.model.vision_tower.requires_grad_(False)
    model.model.language_model.requires_grad_(False)
    model.model.vision_tower.to(torch.float16)
    policy = PrecisionPolicy.from_preset("bf16", keep_fp32=("model.language_model.norm",))
    return model, policy, enforce_policy(model, policy)


def test_picture_rows_split_frozen_and_trainable_with_target_and_before() -> None:
    model, policy, report = _frozen_tower_bf16()
    rows = {
        (r.group, r.role): r
        for r in picture_rows(dtype_map(model, policy=policy), policy=policy, report=report)
    }
    assert set(rows) == {
        ("vision_encoder", "frozen"),
        ("projector", "trainable"),
        ("language_model", "frozen"),
        ("lm_head", "trainable"),
    }
    tower = rows["vision_encoder", "frozen"]
    n = sum(p.numel() for p in model.model.vision_tower.parameters())
    assert tower.now == (("bfloat16", n),) and tower.before == (("float16", n),)
    assert tower.casts == (
        ("float16", "bfloat16", len(list(model.model.vision_tower.parameters()))),
    )
    assert tower.target == "bfloat16" and tower.open == 0 and tower.verdict == "✓"
    lm = rows["language_model", "frozen"]
    norm = model.model.language_model.norm.weight.numel()
    assert dict(lm.now)["float32"] == norm == lm.kept_fp32  # the kept norm, not a mismatch
    assert lm.target == f"bfloat16 + {norm} float32 kept" and lm.verdict == "✓"
    head = rows["lm_head", "trainable"]
    assert head.target == "float32" and head.before is None and head.casts == ()


def test_picture_rows_count_what_an_audit_leaves_off_the_policy() -> None:
    from hf_precision import PrecisionPolicy, enforce_policy

    model = tiny_llava()
    model.model.vision_tower.requires_grad_(False)
    policy = PrecisionPolicy.from_preset("bf16", mode="audit")
    report = enforce_policy(model, policy)
    rows = {
        (r.group, r.role): r
        for r in picture_rows(dtype_map(model, policy=policy), policy=policy, report=report)
    }
    tower = rows["vision_encoder", "frozen"]
    assert tower.open == len(list(model.model.vision_tower.parameters())) > 0
    assert tower.verdict == f"✗ {tower.open} tensor(s) off" and tower.before is None
    assert rows["projector", "trainable"].verdict == "✓"
    # without a policy: the dtypes, no verdict
    bare = picture_rows(dtype_map(model))
    assert all(r.target is None and r.verdict == "" for r in bare)


def test_the_picture_draws_small_dtypes_and_keeps_every_label_inside() -> None:
    from matplotlib.patches import Rectangle
    from matplotlib.text import Text

    from hf_precision.report.plot import MIN_SHARE, precision_figure

    model, policy, report = _frozen_tower_bf16()
    rows = picture_rows(dtype_map(model, policy=policy), policy=policy, report=report)
    fig = precision_figure(rows, title="llava: on_init_end, step 0", subtitle=policy.describe())
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = PICTURE_SIZE
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert any(t.get_text() == "target bfloat16  ✓" for t in texts)
    for t in texts:
        box = t.get_window_extent(renderer)
        assert box.x0 >= 0 and box.y0 >= 0, t.get_text()
        assert box.x1 <= width and box.y1 <= height, t.get_text()
    # the 32 fp32 norm weights among 26K bf16 ones: a slice at least MIN_SHARE of the bar wide
    ax = fig.axes[0]
    fp32 = "#4c72b0"
    lm_row = [r.group for r in rows].index("language_model")
    slices = [
        p
        for p in ax.patches
        if isinstance(p, Rectangle)
        and abs(p.get_y() + p.get_height() / 2 - (lm_row + 0.08)) < 1e-6
        and p.get_facecolor()[:3]
        == pytest.approx(tuple(int(fp32[i : i + 2], 16) / 255 for i in (1, 3, 5)))
    ]
    assert len(slices) == 1 and slices[0].get_width() >= MIN_SHARE * 0.95


def test_the_picture_is_deterministic_and_follows_its_title() -> None:
    model, policy, report = _frozen_tower_bf16()
    rows = picture_rows(dtype_map(model, policy=policy), policy=policy, report=report)
    a = plot_precision(rows, title="llava: on_init_end, step 0")
    assert plot_precision(rows, title="llava: on_init_end, step 0") == a
    assert plot_precision(rows, title="llava: on_train_end, step 3") != a
    assert png_size(a) == PICTURE_SIZE


def test_without_a_report_the_verdict_reads_the_map_against_the_policy() -> None:
    """A standalone picture (no EnforceReport): parameters in a dtype the policy does not want
    for their row are counted off; what the policy keeps in fp32 is not."""
    from hf_precision import PrecisionPolicy

    model = tiny_llava()
    model.model.vision_tower.requires_grad_(False)
    policy = PrecisionPolicy.from_preset("bf16")  # frozen tower: bf16 wanted, fp32 found
    rows = {(r.group, r.role): r for r in picture_rows(dtype_map(model), policy=policy)}
    tower = rows["vision_encoder", "frozen"]
    assert (
        tower.off_params == tower.numel
        and tower.verdict == f"✗ {tower.numel / 1000:.3g}K params off"
    )
    assert rows["projector", "trainable"].verdict == "✓"
    model.model.vision_tower.to(torch.bfloat16)
    kept = policy.replace(keep_fp32=("model.vision_tower.post_layernorm",))
    model.model.vision_tower.post_layernorm.float()
    rows = picture_rows(dtype_map(model, policy=kept), policy=kept)
    assert all(r.verdict == "✓" for r in rows), rows


def test_a_wrappers_report_counts_what_it_lists_once() -> None:
    """A held wrapper's report (DeepSpeed) keeps its audit's plan but lists only the casts the
    policy does not allow: those, once each, are what is off."""
    import copy

    from hf_precision import PrecisionPolicy, enforce_policy
    from hf_precision.engine.records import Change

    model = tiny_llava()
    model.model.vision_tower.requires_grad_(False)
    policy = PrecisionPolicy.from_preset("bf16", group_dtypes={"vision_encoder": "fp32"})
    model.to(torch.bfloat16)  # as DeepSpeed bf16 holds every parameter
    audit = enforce_policy(model, policy, mode="audit")
    tower = [c for c in audit.changes if c.group == "vision_encoder"]
    assert len(audit.changes) > len(tower) > 0
    held = copy.copy(audit)
    held.changes = []
    held.wrapper_casts = [
        Change(c.name, "param", c.group, c.before, c.after, "cast by DeepSpeed") for c in tower
    ]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rows = picture_rows(dtype_map(model), policy=policy, report=held, trainable_names=names)
    assert sum(r.open for r in rows) == len(tower)
    assert {(r.group, r.role) for r in rows if r.open} == {("vision_encoder", "frozen")}
