"""Every public name renamed by the contracts work still imports, as the same object (one minor
release of aliases), and the renamed attributes read the same values."""

from __future__ import annotations

import importlib

import pytest

#: (old module, old name) -> (new module, new name)
RENAMED = {
    ("hf_precision.integrations.axolotl", "PrecisionGuardPluginMethods"): (
        "hf_precision.integrations.axolotl",
        "AxolotlPrecisionPluginMethods",
    ),
}


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_an_old_name_is_the_new_object(old: tuple[str, str], new: tuple[str, str]) -> None:
    assert getattr(importlib.import_module(old[0]), old[1]) is getattr(
        importlib.import_module(new[0]), new[1]
    )


def test_the_axolotl_plugin_path_in_yaml_files_keeps_working() -> None:
    axolotl = pytest.importorskip("axolotl")
    del axolotl
    from hf_precision.integrations import axolotl as plugin

    assert plugin.PrecisionGuardPlugin is plugin.AxolotlPrecisionPlugin
    assert plugin.AxolotlPrecisionPlugin.__name__ == "AxolotlPrecisionPlugin"


def test_the_callbacks_old_attribute_names_read_the_new_ones() -> None:
    from hf_precision import PrecisionGuardCallback

    cb = PrecisionGuardCallback("fp32", report=False)
    assert cb.report is cb.write_reports is False
    assert cb.last_report is cb.last_enforce_report is None
    sentinel = object()
    cb.reporter = sentinel
    assert cb._reporter is sentinel
    cb._reporter = None  # the engine's front-end base still writes the old name
    assert cb.reporter is None
