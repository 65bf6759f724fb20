"""Every registry of :mod:`hf_precision.rules` holds the same entries, in the same order, whatever
a fresh process imports first, and whatever the process is (``python -c``, a script, the
``hf-precision`` command): the built-in group rules, group names, leaf-guarded groups, presets,
metadata/activation keys, quantized classes and the architecture table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: what a fresh process imports first
FIRST = (
    "hf_precision",
    "hf_precision.rules",
    "hf_precision.rules.groups.module_groups",
    "hf_precision.rules.groups.registry",
    "hf_precision.rules.groups.diffusion",
    "hf_precision.rules.policy.precision_policy",
    "hf_precision.rules.policy.presets",
    "hf_precision.rules.batch_keys",
    "hf_precision.rules.flags",
    "hf_precision.rules.groups.group_rule",
    "hf_precision.engine.enforce",
    "hf_precision.frontends.diffusion",
    "hf_precision.tools.cli",
)

#: imports ``sys.argv[1]`` first, then reads every registry and prints it as JSON
_DUMP = """\
import importlib, json, sys
first = sys.argv[1]
importlib.import_module(first)
from hf_precision.rules import batch_keys, dtypes, flags
from hf_precision.rules.groups import group_rule, registry
from hf_precision.rules.policy import presets
from hf_precision.rules.batch_keys import DEFAULT_KEY_GROUPS, DEFAULT_SKIP_KEYS
print(json.dumps({
    "rules": [r.name for r in registry.group_rules()],
    "groups": list(group_rule.group_names()),
    "leaf_guarded": list(group_rule.leaf_guarded_groups()),
    "presets": {k: [str(d) for d in v] for k, v in presets.PRESETS.items()},
    "preset_help": presets.PRESET_HELP,
    "preset_defaults": {k: repr(sorted(v.items())) for k, v in presets.PRESET_DEFAULTS.items()},
    "metadata_keys": batch_keys.METADATA_KEYS,
    "activation_keys": batch_keys.ACTIVATION_KEYS,
    "quantized": [dtypes.QUANTIZED_CLASSES, dtypes.QUANTIZED_MODULES],
    "tools": list(flags.TOOLS),
    "key_groups": DEFAULT_KEY_GROUPS,
    "skip_keys": list(DEFAULT_SKIP_KEYS),
    "table": registry.architecture_table(),
}))
"""


def _dumps(runs: list[tuple[str, list[str]]]) -> dict[str, dict]:
    """name -> the registries its command line printed, each in its own fresh interpreter
    (four at a time)."""
    out: dict[str, dict] = {}
    for i in range(0, len(runs), 4):
        procs = {
            name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, argv in runs[i : i + 4]
        }
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, (name, stderr[-2000:])
            out[name] = json.loads(stdout.splitlines()[-1])
    return out


def test_registries_do_not_depend_on_what_is_imported_first(tmp_path: Path) -> None:
    """Each module of :data:`FIRST` imported first in a process of the console script's name
    (the process the CLI runs in), and two in a ``python -c`` process: one content."""
    script = tmp_path / "hf-precision"
    script.write_text(_DUMP)
    runs = [(m, [sys.executable, str(script), m]) for m in FIRST]
    runs += [(f"-c {m}", [sys.executable, "-c", _DUMP, m]) for m in FIRST[:3:2]]
    dumps = _dumps(runs)
    reference = dumps["hf_precision"]
    # the built-in entries are there: TOML rules, then the diffusion rules, groups and presets
    assert "llava" in reference["rules"] and "diffusion_vae" in reference["rules"]
    assert {"unet", "vae", "text_encoder"} <= set(reference["groups"])
    assert {"unet", "transformer", "resampler"} <= set(reference["leaf_guarded"])
    assert {"fp16-vae32", "bf16-vae32"} <= set(reference["presets"])
    assert reference["table"].count("\n") > 10
    differ = {m: sorted(k for k in d if d[k] != reference[k]) for m, d in dumps.items()}
    assert not {m: keys for m, keys in differ.items() if keys}, differ


def test_a_registered_rule_follows_the_built_in_ones() -> None:
    """A rule registered right after importing the registry (nothing else imported) comes after
    every built-in rule, as it does after ``import hf_precision``."""
    code = (
        "from hf_precision.rules.groups.group_rule import GroupRule\n"
        "from hf_precision.rules.groups.registry import group_rules, register_group_rule\n"
        "register_group_rule(GroupRule('mine', paths={'vision_encoder': 'enc'}))\n"
        "names = [r.name for r in group_rules()]\n"
        "print(names.index('mine'), len(names), 'diffusion_vae' in names)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    index, count, diffusion = run.stdout.split()
    assert int(index) == int(count) - 1 and int(count) > 10 and diffusion == "True"


def test_a_public_name_brings_its_registries() -> None:
    """``import hf_precision`` loads no registry; the first public name that needs one does."""
    code = (
        "import sys, hf_precision\n"
        "before = 'hf_precision.rules.groups.module_groups' in sys.modules\n"
        "p = hf_precision.PrecisionPolicy.from_preset('fp16-vae32')\n"
        "print(before, p.group_dtype('vae'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["False", "torch.float32"]


def test_the_architectures_command_prints_every_rule() -> None:
    """``hf-precision architectures`` (its own process) prints the row of every built-in rule of
    ``group_rules.toml``, in the file's order: the table docs/api.md copies."""
    from importlib import resources

    from hf_precision.rules.groups.registry import RULES_FILE, architecture_table, read_rules

    text = resources.files("hf_precision.rules.groups").joinpath(RULES_FILE).read_text()
    run = subprocess.run(
        [sys.executable, "-m", "hf_precision", "architectures"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout == architecture_table(read_rules(text, RULES_FILE))


def test_the_audit_command_finds_groups_by_the_built_in_rule() -> None:
    """``hf-precision audit llava`` (its own process) groups the model by the built-in rule
    ``llava``, not by the fallback an empty registry leaves."""
    run = subprocess.run(
        [sys.executable, "-m", "hf_precision", "audit", "llava", "--trainable", "none", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(run.stdout)["rule"] == "llava"
