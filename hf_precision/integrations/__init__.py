"""Adapters for the third-party tools people train with: one module per tool, in this folder.

Each module here is imported only when its tool is used (a launcher, a framework's plugin
loader); nothing else in the package imports them, and adding one touches nothing else
(``tests/test_layering.py`` places every module of this folder in the ``frameworks`` layer).

Name no module here after an installed package (``swift``, ``trl``, ``accelerate``...): ms-swift's
``--external_plugins`` puts this folder first on ``sys.path`` when it imports ``ms_swift.py``.
"""
