"""Adapters for the third-party tools people train with: one module per tool, in this folder.

Each module here is imported only when its tool is used (a launcher, a framework's plugin
loader, or ``PrecisionGuardCallback`` when its Trainer's class comes from the tool's package: it
looks the package up in ``TRAINER_ADAPTERS`` (:mod:`hf_precision.frontends.callback`) and calls
that module's ``trainer_models(trainer, init_args)`` for the other models the trainer runs);
nothing imports them statically (a trainer adapter is one row in that table)
(``tests/test_layering.py`` places every module of this folder in the ``frameworks`` layer).

Name no module here after an installed package (``swift``, ``trl``, ``accelerate``...): ms-swift's
``--external_plugins`` puts this folder first on ``sys.path`` when it imports ``ms_swift.py``.
"""
