"""``diagnose(model, batch)``: one recorded forward (+ backward, + ``generate``) that names the
module behind a dtype/device error, or lists the mismatches autocast hides.

Recording forward hooks go on every module: a pre-hook (run before any guard, so it sees what
the module was handed) notes each input's dtype/device and which module produced it (outputs
are tracked by object identity), a post-hook notes what each module produced. When an op fails
with a dtype/device mismatch, the innermost failing call stack is searched, from the outside in,
for the first module whose input differs from its own weights; the error then names that
module, the producer of the offending input, what the policy expected, the root-cause class
(docs/architecture.md: A batch, B component split, C fp32 leak, F tensor made in forward,
G device) and the fix.

>>> import torch
>>> from hf_precision import diagnose
>>> from hf_precision.tiny import tiny_llava, tiny_batch
>>> model = tiny_llava()
>>> report = diagnose(model, tiny_batch(model))
>>> report.ok, report.mismatches
(True, [])
>>> model.model.vision_tower.to(torch.bfloat16)  # doctest: +ELLIPSIS
CLIPVisionModel(...)
>>> try:
...     diagnose(model, tiny_batch(model))
... except Exception as err:
...     print(err.diagnosis.culprit.module, err.diagnosis.root_cause)
model.multi_modal_projector B
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..base.wrapper_kinds import unwrap_model, wrapper_kind, wrapper_of
from ..errors import PrecisionError
from ..rules.dtypes import dtype_name, is_castable
from ..rules.groups.module_groups import ModuleGroups, find_module_groups
from ..rules.policy.precision_policy import PrecisionPolicy
from ..watch.diagnosis import (
    Diagnosis,
    Mismatch,
    MismatchKind,
    classify,
    expected_text,
    fix_text,
    module_weights,
)

__all__ = ["diagnose", "is_mismatch_error"]

#: PyTorch's wordings of dtype and device mismatches (CPU and CUDA), and the guard's own.
_MISMATCH = re.compile(
    r"must have the same dtype|expected m1 and m2 to have the same dtype|expected scalar type"
    r"|Input type \(.*\) and (weight|bias) type|to match query dtype|Expected attn_mask dtype"
    r"|expected both inputs to have the same dtype|Found dtype \w+ but expected"
    r"|same device|not on the expected device|found at least two devices"
    r"|Expected all tensors to be on the same device|but its weights are",
    re.IGNORECASE,
)


def is_mismatch_error(err: BaseException) -> bool:
    """Is ``err`` one of PyTorch's dtype/device mismatch errors (or the guard's)?"""
    if isinstance(err, PrecisionError):  # raised by a guard in mode="raise"
        return True
    return isinstance(err, RuntimeError) and bool(_MISMATCH.search(str(err)))


def _tensors(value: Any, name: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif depth < 2 and isinstance(value, (list, tuple)):
        for i, v in enumerate(value[:64]):
            yield from _tensors(v, f"{name}[{i}]", depth + 1)
    elif depth < 2 and isinstance(value, Mapping):
        for k, v in list(value.items())[:64]:
            yield from _tensors(v, f"{name}.{k}" if name else str(k), depth + 1)


class _Recorder:
    """The hooks and what they saw."""

    def __init__(
        self,
        root: nn.Module,
        groups: ModuleGroups,
        batch: Mapping[str, Any],
        policy: PrecisionPolicy,
    ) -> None:
        from ..engine.batch import key_dtypes_for
        from ..model.dtype_maps import receiving_dtypes

        self.root, self.groups, self.policy = root, groups, policy
        # What the batch guard would want for each top-level batch key (mode="raise" errors).
        self.key_dtypes = key_dtypes_for(policy, receiving_dtypes(root, groups))
        self.root_found: list[Mismatch] = []
        self.paths = {id(m): p for p, m in root.named_modules()}
        self.types = {p: type(m).__name__ for p, m in root.named_modules()}
        roots = {p for ps in groups.paths.values() for p in ps}
        # Candidates: modules with their own floating weights, and group entries.
        self.weights: dict[str, tuple[torch.dtype, torch.device | None]] = {}
        self.all_weights: dict[str, tuple[torch.dtype | None, torch.device | None]] = {}
        for path, mod in root.named_modules():
            if mod is root or isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
                continue
            dt, dev = module_weights(mod, own=path not in roots)
            if dt is not None:
                self.weights[path] = (dt, dev)
        self.produced: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        for key, t in _tensors(dict(batch), ""):
            self.produced[id(t)] = (weakref.ref(t), f"batch[{key!r}]")
        self.stack: list[str] = []
        self.last_done: str | None = None
        self.phase = "forward"
        self.calls = 0
        self.found: dict[tuple[Any, ...], Mismatch] = {}
        self.handles: list[Any] = []

    def weights_of(self, path: str) -> tuple[torch.dtype | None, torch.device | None]:
        if path not in self.all_weights:
            self.all_weights[path] = module_weights(self.root.get_submodule(path), own=False)
        return self.all_weights[path]

    def producer_of(self, t: torch.Tensor) -> tuple[str, str | None]:
        # A view (slice, reshape, transpose) of a module's output keeps that module as producer.
        for cand in (t, t._base):
            if cand is None:
                continue
            hit = self.produced.get(id(cand))
            if hit is not None and hit[0]() is cand:
                return hit[1], hit[1] if not hit[1].startswith("batch[") else None
        caller = self.stack[-1] if self.stack else ""
        after = f", after {self.last_done}" if self.last_done else ""
        return f"made inside {caller or '<model>'}.forward{after}", None

    # ------------------------------------------------------------------ hooks
    def pre(self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        path = self.paths.get(id(mod))
        if path is None:
            return
        self.calls += 1
        if mod is self.root:
            self._note_batch(kwargs)
        want = self.weights.get(path)
        if want is not None:
            wdt, wdev = want
            items = list(_tensors(args, "input")) + list(_tensors(kwargs, ""))
            for name, t in items:
                bad_dtype = t.is_floating_point() and t.dtype != wdt and is_castable(t)
                bad_dev = wdev is not None and t.device != wdev and t.dim() > 0
                if bad_dtype or bad_dev:
                    self._note(path, name, t, wdt, wdev, bad_dtype, bad_dev)
        self.stack.append(path)

    def post(self, mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        path = self.paths.get(id(mod))
        if path is None:
            return
        if self.stack and self.stack[-1] == path:
            self.stack.pop()
        self.last_done = path
        for _, t in _tensors(output, "output"):
            old = self.produced.get(id(t))
            if old is None or old[0]() is not t:  # innermost producer wins
                self.produced[id(t)] = (weakref.ref(t), path)

    def _note_batch(self, kwargs: dict[str, Any]) -> None:
        for key, t in kwargs.items():
            if not isinstance(t, torch.Tensor) or key in self.policy.batch_skip_keys:
                continue
            want = self.key_dtypes.get(key, self.policy.compute_dtype)
            if is_castable(t) and t.dtype != want:
                self.root_found.append(
                    Mismatch(
                        module="",
                        module_type=type(self.root).__name__,
                        group="batch",
                        input=key,
                        input_dtype=dtype_name(t.dtype),
                        input_device=str(t.device),
                        weight_dtype=dtype_name(want),
                        weight_device="",
                        producer=f"batch[{key!r}]",
                        phase=self.phase,
                        autocast=torch.is_autocast_enabled(t.device.type),
                    )
                )

    def _note(
        self,
        path: str,
        name: str,
        t: torch.Tensor,
        wdt: torch.dtype,
        wdev: torch.device | None,
        bad_dtype: bool,
        bad_dev: bool,
    ) -> None:
        producer, pmod = self.producer_of(t)
        key = (self.phase, path, name, t.dtype, t.device, producer)
        hit = self.found.get(key)
        if hit is not None:
            hit.count += 1
            return
        pdt = pgroup = None
        if pmod is not None:
            pdt_, _ = self.weights_of(pmod)
            pdt = dtype_name(pdt_) if pdt_ is not None else None
            pgroup = self.groups.group_of(pmod)
        autocast = any(torch.is_autocast_enabled(d) for d in ("cpu", t.device.type))
        kind: MismatchKind = (
            "dtype+device" if bad_dtype and bad_dev else "dtype" if bad_dtype else "device"
        )
        self.found[key] = Mismatch(
            module=path,
            module_type=self.types.get(path, "?"),
            group=self.groups.group_of(path),
            input=name,
            input_dtype=dtype_name(t.dtype),
            input_device=str(t.device),
            weight_dtype=dtype_name(wdt),
            weight_device=str(wdev) if wdev is not None else "",
            producer=producer,
            producer_module=pmod,
            producer_group=pgroup,
            producer_dtype=pdt,
            kind=kind,
            phase=self.phase,
            autocast=autocast,
            order=len(self.found),
        )

    def install(self) -> None:
        for mod in self.root.modules():
            self.handles.append(
                mod.register_forward_pre_hook(self.pre, with_kwargs=True, prepend=True)
            )
            self.handles.append(mod.register_forward_hook(self.post, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _culprit(rec: _Recorder, stack: list[str]) -> Mismatch | None:
    """Outermost module on the failing call stack whose input differs from its weights."""
    found = [m for m in rec.found.values() if m.phase == rec.phase]
    if stack == [""]:  # raised on entry of the model itself: the batch guard
        batch = [m for m in rec.root_found if m.phase == rec.phase]
        if batch:
            return batch[0]
    for path in stack:
        hits = [m for m in found if m.module == path]
        if hits:
            return hits[-1]
    return found[-1] if found else None


def _grads(root: nn.Module) -> dict[int, torch.Tensor | None]:
    return {id(p): p.grad for p in root.parameters()}


def _restore_grads(root: nn.Module, saved: dict[int, torch.Tensor | None]) -> None:
    for p in root.parameters():
        if id(p) in saved:
            p.grad = saved[id(p)]


def _loss(out: Any) -> torch.Tensor | None:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    for _, t in _tensors(out, "output"):
        if t.is_floating_point() and t.requires_grad:
            return t.float().mean()
    return None


def diagnose(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    backward: bool = True,
    generate: bool = False,
    policy: PrecisionPolicy | str | None = None,
    autocast: torch.dtype | str | None = None,
    forward: bool = True,
    max_new_tokens: int = 2,
    raise_on_error: bool = True,
) -> Diagnosis:
    """Run one recorded forward (+ backward, + ``generate``) of ``model`` on ``batch``.

    On a dtype/device error raise :class:`PrecisionError` (the :class:`Diagnosis` is attached
    as ``err.diagnosis``; with ``raise_on_error=False`` it is returned instead). Otherwise the
    :class:`Diagnosis` lists every module whose input dtype/device differed from its weights
    (the mismatches autocast or the op's own upcasting hid). ``autocast`` runs the forward under
    ``torch.autocast`` in that dtype, as ``Trainer(bf16=True)`` does; ``forward=False`` with
    ``generate=True`` runs ``generate()`` alone. Gradients are restored and nothing in the model
    is cast: diagnosis only reads.
    """
    root, _ = unwrap_model(model)
    pol = PrecisionPolicy.resolve(policy, root)
    groups = find_module_groups(root)
    rec = _Recorder(root, groups, batch, pol)
    diag = Diagnosis(model=type(root).__name__, policy=pol.describe())
    saved = _grads(root)
    ac_dtype = _autocast_dtype(model, autocast)
    phases = (["forward"] + (["backward"] if backward else []) if forward else []) + (
        ["generate"] if generate else []
    )
    gen = {k: v for k, v in batch.items() if k not in pol.batch_skip_keys}
    gen["max_new_tokens"] = max_new_tokens
    if hasattr(root, "generation_config"):  # transformers' GenerationMixin
        gen["do_sample"] = False
    rec.install()
    try:
        failure = _run_phases(model, batch, phases, rec, diag, pol, ac_dtype, backward, gen)
    finally:
        rec.remove()
        _restore_grads(root, saved)
    diag.calls = rec.calls
    diag.mismatches = sorted(rec.found.values(), key=lambda m: m.order)
    if diag.error is not None and raise_on_error:
        exc = PrecisionError(str(diag))
        exc.diagnosis = diag  # type: ignore[attr-defined]
        raise exc from failure
    return diag


def _autocast_dtype(model: nn.Module, autocast: torch.dtype | str | None) -> torch.dtype | None:
    """The dtype ``diagnose(autocast=...)`` runs the forward in (refused under DeepSpeed)."""
    if autocast is None:
        return None
    from ..rules.dtypes import parse_dtype

    ac_dtype = parse_dtype(autocast, call=f"diagnose(autocast={autocast!r})")
    _refuse_deepspeed_autocast(model, autocast)
    return ac_dtype


def _run_phases(
    model: nn.Module,
    batch: Mapping[str, Any],
    phases: list[str],
    rec: _Recorder,
    diag: Diagnosis,
    pol: PrecisionPolicy,
    ac_dtype: torch.dtype | None,
    backward: bool,
    gen: dict[str, Any],
) -> RuntimeError | None:
    """Each phase in turn, recorded; the first dtype/device error is explained in ``diag`` and
    returned (any other error propagates)."""
    root = rec.root
    device_type = next((p.device.type for p in root.parameters()), "cpu")
    out: Any = None
    for phase in phases:
        rec.phase, rec.stack, rec.last_done = phase, [], None
        ctx = (
            torch.autocast(device_type, dtype=ac_dtype)
            if ac_dtype is not None and phase != "backward"
            else contextlib.nullcontext()
        )
        try:
            with ctx:
                out, diag.passes[phase] = _run_phase(phase, model, batch, out, backward, gen)
        except RuntimeError as err:
            if not is_mismatch_error(err):
                raise
            diag.passes[phase] = "failed"
            _explain(diag, rec, pol, err, phase)
            return err
    return None


def _run_phase(
    phase: str,
    model: nn.Module,
    batch: Mapping[str, Any],
    out: Any,
    backward: bool,
    gen: Mapping[str, Any],
) -> tuple[Any, str]:
    """One phase of :func:`diagnose`: (the output the next phase reads, how the pass went).
    ``gen`` holds the ``generate()`` arguments (the batch without its skipped keys)."""
    if phase == "forward":
        with torch.set_grad_enabled(backward):
            return model(**batch), "ok"
    if phase == "backward":
        loss = _loss(out)
        if loss is None:
            return out, "skipped: no loss or nothing trainable"
        loss.backward()
        return None, "ok"
    with torch.no_grad():
        model.generate(**gen)  # type: ignore[operator]
    return out, "ok"


def _explain(
    diag: Diagnosis, rec: _Recorder, pol: PrecisionPolicy, err: RuntimeError, phase: str
) -> None:
    diag.error = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
    diag.phase = phase
    stack = list(rec.stack)
    diag.failed_in = stack[-1] if stack else None
    diag.failing_stack = stack
    culprit = _culprit(rec, stack)
    diag.culprit = culprit
    if culprit is None:
        diag.fix = (
            "no module input differed from its weights before the failure (it happened "
            "in a functional op or in autograd): run the guard with "
            "PrecisionGuardCallback(mode='fix') or diagnose(..., backward=False) to "
            "narrow it down."
        )
        return
    from ..engine.enforce import check_policy

    try:
        for c in check_policy(rec.root, pol, groups=rec.groups).changes:
            diag.violations[c.group] = diag.violations.get(c.group, 0) + 1
    except PrecisionError:  # e.g. meta tensors on a model that lives elsewhere
        pass
    cls = classify(rec.root, rec.groups, culprit)
    diag.root_cause = cls
    diag.expected = expected_text(rec.root, pol, culprit)
    intended = not ({culprit.group, culprit.producer_group} & set(diag.violations))
    diag.fix = fix_text(cls, culprit, pol, intended)


def _refuse_deepspeed_autocast(model: nn.Module, autocast: object) -> None:
    """The guard never opens ``torch.autocast`` around a DeepSpeed engine: DeepSpeed >= 0.17.2
    owns autocast (its ``torch_autocast`` section), asserts when one is open outside it on a GPU
    and, from 0.19.8, switches it off without a word (its check reads CUDA autocast only)."""
    kind = wrapper_kind(wrapper_of(model))
    if kind is not None and kind.owns_autocast:
        raise PrecisionError(
            f"diagnose(autocast={autocast!r}): DeepSpeed holds this model ({type(model).__name__}"
            "); DeepSpeed owns autocast and the guard never opens one around its engine (it "
            "asserts 'torch.autocast is enabled outside DeepSpeed' on a GPU, or turns it off). "
            "Fix: drop autocast= (the engine computes in its config's dtype; for autocast set "
            '"torch_autocast": {"enabled": true, "dtype": "bfloat16"} in the DeepSpeed config), '
            "or diagnose the model before deepspeed.initialize / Trainer wraps it."
        )
