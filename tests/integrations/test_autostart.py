"""The interpreter-start hook: off unless ``HF_PRECISION_GUARD`` asks, standard library only,
and it patches ``transformers.trainer`` when (and only when) that module is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_precision.integrations import autostart, launch_cli, launcher

ROOT = Path(__file__).resolve().parents[2]
LOAD = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location("
    f"'_hf_precision_autostart', {autostart.__file__!r})\n"
    "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
)


@pytest.mark.parametrize(
    ("value", "on"),
    [
        (None, False),
        ("", False),
        ("0", False),
        ("OFF", False),
        (" no ", False),
        ("auto", True),
        ("bf16", True),
        ('{"compute_dtype": "bf16"}', True),
    ],
)
def test_enabled(value, on):
    env = {} if value is None else {autostart.ENV_GUARD: value}
    assert autostart.enabled(env) is on


def _python(code: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_PRECISION_")}
    proc = subprocess.run(
        [sys.executable, "-c", LOAD + code],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # other libraries print to stdout too: the probe's lines start with "@"
    return [w for x in proc.stdout.splitlines() if x.startswith("@") for w in x[1:].split()]


def test_the_hook_waits_for_transformers_trainer():
    code = (
        "print('@', m.activate(), m.activate(), sum(hasattr(f, m._MARK) for f in sys.meta_path))\n"
        "import transformers, torch\n"
        "print('@', 'transformers.trainer' in sys.modules, 'hf_precision' in sys.modules)\n"
        "from transformers import Trainer\n"
        "print('@', getattr(Trainer.__init__, '_hf_precision_wrapped', False), "
        "type(sys.modules['transformers.trainer'].__loader__).__name__)\n"
        "m.deactivate(); print('@', sum(hasattr(f, m._MARK) for f in sys.meta_path))\n"
    )
    out = _python(code, HF_PRECISION_GUARD="auto")
    # idempotent; nothing before the Trainer module; then patched through the real loader
    assert out == ["True", "True", "1", "False", "False", "True", "_PatchingLoader", "0"]


def test_off_means_no_hook():
    out = _python(
        "print('@', m.activate(), len([f for f in sys.meta_path if hasattr(f, m._MARK)]))",
        HF_PRECISION_GUARD="off",
    )
    assert out == ["False", "0"]


def test_activate_after_transformers_trainer_was_imported(monkeypatch):
    from accelerate import Accelerator
    from transformers import Trainer

    from hf_precision.integrations import accelerate_hook

    monkeypatch.setenv(autostart.ENV_GUARD, "auto")
    try:
        assert autostart.activate()
        assert getattr(Trainer.__init__, "_hf_precision_wrapped", False)
        # patched at once; the one finder left waits for what is not imported yet (OneTrainer)
        assert sum(hasattr(f, autostart._MARK) for f in sys.meta_path) <= 1
    finally:
        launcher.unpatch_trainer(Trainer)
        # accelerate is imported too, so its Accelerator was patched at once: undone as well
        # (left patched, a later test's patch_accelerator found it done)
        accelerate_hook.unpatch_accelerator(Accelerator)
        autostart.deactivate()
    assert not hasattr(Trainer.__init__, "_hf_precision_wrapped")
    assert not hasattr(Accelerator.__init__, "_hf_precision_wrapped")


def test_a_python_without_hf_precision_says_it_trains_unguarded(tmp_path):
    """The hook reached a Python where the package cannot be imported (another venv under the
    same ``hf-precision run``): one clear line, and the Trainer module still loads."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("")
    (tmp_path / "transformers" / "trainer.py").write_text("class Trainer:\n    pass\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_PRECISION_")}
    code = LOAD + "m.ON_IMPORT = 'no_such_package.launcher:patch'\nm.activate()\n"
    code += "import transformers.trainer; print('loaded')"
    proc = subprocess.run(  # -S: no site-packages, so no start-up line of an install runs
        [sys.executable, "-S", "-c", code],
        env={**clean, "PYTHONPATH": str(tmp_path), "HF_PRECISION_GUARD": "auto"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "loaded"
    assert "trains WITHOUT the precision guard" in proc.stderr
    assert "pip install hf-precision" in proc.stderr


def _import_twice(*flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_PRECISION_")}
    code = "import hf_precision, importlib; importlib.reload(hf_precision)"
    return subprocess.run(
        [sys.executable, *flags, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_variable_without_the_start_up_hook_is_said_once_on_import():
    """A Python without ``hf_precision_guard.pth`` (a checkout on ``PYTHONPATH``; made here with
    ``-S``, since both installs ship the line): ``HF_PRECISION_GUARD`` alone would guard
    nothing. ``import hf_precision`` (the one-line check) says so once, with the fix."""
    proc = _import_twice("-S", PYTHONPATH=str(ROOT), HF_PRECISION_GUARD="auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [x for x in proc.stderr.splitlines() if x.startswith("hf-precision:")]
    assert said == [autostart.MISSING_HOOK.format(env="HF_PRECISION_GUARD", exe=sys.executable)]
    assert "`hf-precision install-hook`" in said[0]


@pytest.mark.parametrize("guard", ["", "0", "off"])
def test_no_variable_no_word(guard):
    proc = _import_twice(PYTHONPATH=str(ROOT), HF_PRECISION_GUARD=guard)
    assert proc.returncode == 0 and "hf-precision:" not in proc.stderr, proc.stderr[-2000:]


def test_with_the_start_up_hook_nothing_is_said():
    """``hf-precision run``'s ``sitecustomize`` (as the ``.pth`` line) loads the hook first."""
    path = os.pathsep.join([str(launch_cli.BOOT_DIR), str(ROOT)])
    proc = _import_twice(PYTHONPATH=path, HF_PRECISION_GUARD="auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "start-up hook is not installed" not in proc.stderr


def test_the_pth_line_counts_as_the_hook(tmp_path):
    """The line ``hf-precision install-hook`` writes, run by a site folder at start."""
    launch_cli.install_hook(tmp_path)
    code = f"import site; site.addsitedir({str(tmp_path)!r}); import hf_precision"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_PRECISION_")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTHONPATH": str(ROOT), "HF_PRECISION_GUARD": "auto"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "start-up hook is not installed" not in proc.stderr


STEP = (
    "import torch\n"
    "m = torch.nn.Linear(2, 2)\n"
    "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
    "{guard}"
    "m(torch.ones(1, 2)).sum().backward()\n"
    "{step}"
)


def _launched(code: str, guard: str = "auto") -> subprocess.CompletedProcess[str]:
    """``code`` as ``hf-precision run -- python -c CODE`` runs it (its ``sitecustomize``)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_PRECISION_")}
    path = os.pathsep.join([str(launch_cli.BOOT_DIR), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTHONPATH": path, "HF_PRECISION_GUARD": guard},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_launched_process_that_trained_unguarded_says_so_at_exit():
    """A loop the launcher does not know (plain PyTorch: no Trainer, no Accelerator.prepare,
    no OneTrainer) steps an optimizer: one line at exit, with why and the fix; never silent."""
    proc = _launched(STEP.format(guard="", step="opt.step()\nopt.step()\n"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [x for x in proc.stderr.splitlines() if "reached no model" in x]
    assert said == [autostart.UNREACHED.format(env="HF_PRECISION_GUARD", prog="-c")]
    assert "stepped an optimizer" in said[0] and "Fix: guard the models" in said[0]


@pytest.mark.parametrize(
    ("guard", "step", "env"),
    [
        (
            "from hf_precision import install_guards\ninstall_guards(m, 'fp32')\n",
            "opt.step()\n",
            "auto",
        ),
        ("", "", "auto"),  # never trained (a launcher's parent process, a data script)
        ("", "opt.step()\n", "0"),  # the guard was not asked for
    ],
    ids=["guarded-by-hand", "no-step", "off"],
)
def test_no_exit_line_when_a_guard_reached_a_model_or_nothing_trained(guard, step, env):
    proc = _launched(STEP.format(guard=guard, step=step), guard=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reached no model" not in proc.stderr
