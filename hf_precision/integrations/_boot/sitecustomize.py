"""``hf-precision run`` puts this folder first on ``PYTHONPATH``, so every Python process it
starts (and their children: torchrun/accelerate/deepspeed workers inherit the environment)
imports this file at start-up, as OpenTelemetry's ``opentelemetry-instrument`` does.

It loads ``../autostart.py`` by path (standard library only: no torch, no hf_precision package),
activates it when ``HF_PRECISION_GUARD`` is set, takes this folder off ``sys.path`` again and
runs the ``sitecustomize`` this one shadowed (a distribution's or a virtualenv's), if any.
"""

import os
import sys


def _load_autostart() -> None:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "autostart.py")
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("_hf_precision_autostart", path)
        if spec is None or spec.loader is None:
            return
        module = sys.modules.get("_hf_precision_autostart")
        if module is None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules["_hf_precision_autostart"] = module
        module.activate()
    except Exception as err:  # never break the interpreter's start
        print(f"hf-precision: the launcher hook failed to load ({err!r})", file=sys.stderr)


def _chain() -> None:
    """Import the next ``sitecustomize`` on the path, the one this file shadows."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    me = sys.modules.pop("sitecustomize", None)
    try:
        import importlib

        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as err:
        if err.name != "sitecustomize":
            raise
        if me is not None:
            sys.modules["sitecustomize"] = me


if "HF_PRECISION_GUARD" in os.environ:
    _load_autostart()
if __name__ == "sitecustomize":
    _chain()
