"""``hf-precision run`` puts this folder first on ``PYTHONPATH``, so every Python process it
starts (and their children: torchrun/accelerate/deepspeed workers inherit the environment)
imports this file at start-up, as OpenTelemetry's ``opentelemetry-instrument`` does.

It loads ``../autostart.py`` by path (standard library only: no torch, no hf_precision package),
activates it when ``HF_PRECISION_GUARD`` is set, takes this folder off ``sys.path`` again and
runs the ``sitecustomize`` this one shadowed (a distribution's or a virtualenv's), if any.
"""

import os
import sys

OFF_VALUES = ("", "0", "off", "false", "no", "none")


def _load_autostart() -> None:
    name = "_hf_precision_autostart"
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "autostart.py")
    try:
        # importlib.machinery is loaded at start anyway (importlib.util would add ~30 modules)
        from importlib.machinery import SourceFileLoader

        module = sys.modules.get(name)
        if module is None:
            module = sys.modules[name] = type(sys)(name)
            module.__file__ = path
            SourceFileLoader(name, path).exec_module(module)
        module.activate()
    except Exception as err:  # never break the interpreter's start
        sys.modules.pop(name, None)
        print(f"hf-precision: the launcher hook failed to load ({err!r})", file=sys.stderr)


def _chain() -> None:
    """Import the next ``sitecustomize`` on the path, the one this file shadows."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    me = sys.modules.pop("sitecustomize", None)
    try:
        __import__("sitecustomize")
    except ModuleNotFoundError as err:
        if err.name != "sitecustomize":
            raise
        if me is not None:
            sys.modules["sitecustomize"] = me


# the same off values as autostart.OFF_VALUES (this file cannot import it before it is loaded)
if os.environ.get("HF_PRECISION_GUARD", "").strip().lower() not in OFF_VALUES:
    _load_autostart()
if __name__ == "sitecustomize":
    _chain()
