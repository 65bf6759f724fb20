"""The policy in an accelerate checkpoint (:mod:`hf_precision.frontends.accelerate_checkpoint`);
the save/load round trip through a real ``accelerator.save_state`` is in
test_accelerate_plugin.py."""

from __future__ import annotations

import pytest

from hf_precision import PrecisionError, PrecisionGuardPlugin, PrecisionPolicy, PrecisionWarning
from hf_precision.frontends import accelerate_checkpoint, accelerate_plugin
from hf_precision.frontends.accelerate_checkpoint import (
    POLICY_FILE,
    STATE_VERSION,
    policy_from_checkpoint,
)


def test_the_old_import_paths_are_the_same_objects():
    assert accelerate_plugin.POLICY_FILE == POLICY_FILE == "precision_policy.json"
    assert accelerate_plugin.policy_from_checkpoint is policy_from_checkpoint


def test_policy_from_checkpoint_reads_the_file_or_names_the_fix(tmp_path):
    with pytest.raises(PrecisionError, match="no precision_policy.json there. Fix:"):
        policy_from_checkpoint(tmp_path)
    policy = PrecisionPolicy.from_preset("bf16", keep_fp32=("lm_head",))
    (tmp_path / POLICY_FILE).write_text(policy.to_json())
    assert policy_from_checkpoint(tmp_path) == policy
    assert policy_from_checkpoint(tmp_path / POLICY_FILE) == policy


def test_state_dict_round_trip_and_an_unknown_state_refused():
    plugin = PrecisionGuardPlugin("bf16", report=False)
    plugin.steps = 7
    state = plugin.state_dict()
    assert state == {"version": STATE_VERSION, "policy": plugin.policy.to_dict(), "steps": 7}
    other = PrecisionGuardPlugin("fp32", report=False)
    with pytest.warns(PrecisionWarning, match="the checkpoint's policy .* replaces"):
        other.load_state_dict(state)
    assert other.policy == plugin.policy and other.steps == 7
    with pytest.raises(PrecisionError, match=r"unknown state \['policy'\] \(version None\)"):
        other.load_state_dict({"policy": state["policy"]})
    assert isinstance(other, accelerate_checkpoint.PluginCheckpointing)
