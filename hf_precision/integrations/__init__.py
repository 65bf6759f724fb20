"""Adapters for the third-party tools people train with: one module per tool, in this folder.

Each module here is imported only when its tool is used (a launcher, a framework's plugin
loader); nothing else in the package imports them, and adding one touches nothing else
(``tests/test_layering.py`` places every module of this folder in the ``frameworks`` layer).
"""
