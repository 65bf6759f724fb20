"""The one build step pyproject.toml cannot declare: ``hf_precision_guard.pth`` at the root of
the wheel (site-packages), next to the packages, not inside one. Python runs its one line at
every start; it does nothing unless ``HF_PRECISION_GUARD`` is set (docs/frameworks.md). The line
lives in ``hf_precision/integrations/hf_precision_guard.pth``; this copies it to the root of the
wheel, and of the editable wheel ``pip install -e .`` builds (PEP 660: setuptools points the
``install`` command's ``install_lib`` at that wheel's root while ``build_py`` runs in
``editable_mode``), so both installs carry it.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "hf_precision_guard.pth"
SOURCE = os.path.join("hf_precision", "integrations", PTH)


class BuildPyWithPth(build_py):
    """``build_py`` plus the start-up line at the root of ``build_lib``."""

    def run(self) -> None:
        super().run()
        self.copy_file(SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=False)
        if getattr(self, "editable_mode", False):  # pip install -e: the editable wheel's root
            root = getattr(self.distribution.get_command_obj("install"), "install_lib", None)
            if root and os.path.isdir(root):
                self.copy_file(SOURCE, os.path.join(root, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        return [*outputs, os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
