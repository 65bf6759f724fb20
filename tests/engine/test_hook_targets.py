"""Where the guards go and what they target (``hf_precision.engine.hook_targets``)."""

from hf_precision import PrecisionPolicy, enforce_policy, find_module_groups, install_guards
from hf_precision.engine.hook_targets import handover_roots
from hf_precision.tiny import tiny_llava


def test_exit_hooks_sit_where_features_leave_the_image_path():
    from hf_precision.tiny import tiny_blip2, tiny_idefics2, tiny_idefics3, tiny_qwen2_vl

    cases = {
        tiny_llava: ["model.multi_modal_projector"],
        # no projector: the resampler hands over, through the vision tower that holds it
        tiny_qwen2_vl: ["model.visual"],
        tiny_idefics3: ["model.connector"],  # the projector sits inside the connector
        tiny_idefics2: ["model.connector"],  # projection, then perceiver: their common module
        tiny_blip2: ["language_projection"],  # qformer and projection beside the LM: the last
    }
    for build, expected in cases.items():
        model = build()
        groups = find_module_groups(model)
        assert [p for p, _ in handover_roots(model, groups)] == expected, build.__name__
    model = tiny_llava()
    audit = PrecisionPolicy.from_preset("bf16-true", mode="audit")
    assert install_guards(model, audit, enforce_policy(model, audit)).exit == []
