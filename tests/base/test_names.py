"""The names a command line checks before torch loads are the registries' own."""

from __future__ import annotations

from hf_precision.base.names import (
    GROUP_NAMES,
    PRESET_MISNAMES,
    PRESET_NAMES,
    preset_hint,
    unknown_groups,
)


def test_the_lists_are_the_registries() -> None:
    from hf_precision.rules.groups.group_rule import group_names
    from hf_precision.rules.policy.presets import PRESETS

    assert tuple(PRESETS) == PRESET_NAMES and group_names() == GROUP_NAMES


def test_misnames_point_at_presets_and_typos_at_the_closest() -> None:
    assert all(any(f"'{p}'" in v for p in PRESET_NAMES) for v in PRESET_MISNAMES.values())
    assert preset_hint("16-mixed", PRESET_NAMES).startswith(" Did you mean 'fp16' (Lightning")
    assert preset_hint("zzzz", PRESET_NAMES) == ""
    assert unknown_groups("projector, none") is None
    assert "Did you mean 'projector'" in (unknown_groups("all,projecter") or "")
