"""The policy's JSON form: field names checked once, saved policies read forward-compatibly,
JSON text that breaks said where. :class:`~hf_precision.PrecisionPolicy`'s
``to_dict``/``from_dict``/``to_json``/``from_json`` call these, and ``resolve`` reads a policy
spelled as JSON text or a file through :func:`spec_object`."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Container, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ...errors import PrecisionError, PrecisionWarning
from ..dtypes import dtype_name

POLICY_VERSION = 1


def shorten(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters for a message that repeats a call."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def as_kwargs(names: Iterable[str]) -> str:
    return ", ".join(f"{n}=..." for n in names)


def reject_unknown_fields(
    given: Iterable[str], known: Iterable[str], call: Callable[[list[str]], str]
) -> None:
    """The one check of field names: ``call(bad)`` is how the user called us."""
    known = set(known)
    bad = sorted(set(given) - known)
    if bad:
        raise PrecisionError(
            f"{call(bad)}: unknown field(s) {bad}.\nAllowed: {', '.join(sorted(known))}."
        )


def _encode(v: Any) -> Any:
    if isinstance(v, torch.dtype):
        return dtype_name(v)
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return list(v)
    return v


def encode_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A policy's fields as JSON values (dtypes by name), with the policy version."""
    out = {k: _encode(v) for k, v in fields.items()}
    out["version"] = POLICY_VERSION
    return out


def decode_fields(data: Mapping[str, Any], known: frozenset[str]) -> dict[str, Any]:
    """The constructor keywords of a dict from ``to_dict`` (or a hand-written one): see
    :meth:`hf_precision.rules.policy.precision_policy.PrecisionPolicy.from_dict`."""
    if not isinstance(data, Mapping):
        raise PrecisionError(
            f"PrecisionPolicy.from_dict({shorten(data)}): expected a dict of policy fields "
            f"(PrecisionPolicy.to_dict()), got a value of type {type(data).__name__}. "
            "Fix: pass that dict, or use PrecisionPolicy.from_json(text) / "
            "PrecisionPolicy.from_preset(name)."
        )
    data = dict(data)
    saved = "version" in data
    version = data.pop("version", POLICY_VERSION)
    if not isinstance(version, int) or version < 1:
        raise PrecisionError(
            f"PrecisionPolicy.from_dict(version={version!r}): policy versions are integers "
            f">= 1 (this hf-precision writes {POLICY_VERSION}). Fix: re-save the policy with "
            "PrecisionPolicy.to_json()."
        )
    unknown = sorted(set(data) - set(known))
    if saved and unknown:
        newer = f" (saved as policy version {version}, this hf-precision reads {POLICY_VERSION})"
        warnings.warn(
            f"PrecisionPolicy.from_dict(...): ignoring field(s) {unknown} this hf-precision "
            f"does not know{newer if version > POLICY_VERSION else ''}. Fix: upgrade "
            "hf-precision to honour them, or drop them from the saved policy.",
            PrecisionWarning,
            stacklevel=3,
        )
        data = {k: v for k, v in data.items() if k in known}
    reject_unknown_fields(data, known, lambda bad: "PrecisionPolicy.from_dict(...)")
    return data


def to_json_text(data: Mapping[str, Any], **kwargs: Any) -> str:
    return json.dumps(data, indent=kwargs.pop("indent", 2), **kwargs)


def json_object(text: Any) -> dict[str, Any]:
    """The JSON object in ``text`` (a policy's ``to_json`` output), else a
    :class:`PrecisionError` that says where it broke."""
    shown = shorten(text)
    if not isinstance(text, str | bytes | bytearray):
        raise PrecisionError(
            f"PrecisionPolicy.from_json({shown}): expected the JSON text of a policy, got a "
            f"value of type {type(text).__name__}. Fix: pass policy.to_json() output; for a "
            "dict use PrecisionPolicy.from_dict(...), for a file PrecisionPolicy.from_json("
            "Path(...).read_text())."
        )
    try:
        data = json.loads(text)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise PrecisionError(
            f"PrecisionPolicy.from_json({shown}): not valid JSON ({err}). Fix: pass the text "
            "PrecisionPolicy.to_json() wrote (a saved policy.json), not a preset name or a "
            "path: PrecisionPolicy.from_preset('bf16'), PrecisionPolicy.from_json("
            "Path(...).read_text())."
        ) from None
    if not isinstance(data, dict):
        raise PrecisionError(
            f"PrecisionPolicy.from_json({shown}): the JSON is a {type(data).__name__}, not "
            "an object of policy fields. Fix: pass the text PrecisionPolicy.to_json() wrote."
        )
    return data


def _is_file(text: str | Path) -> bool:
    try:
        return Path(text).expanduser().is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte
        return False


def spec_object(spec: str | Path, presets: Container[str]) -> dict[str, Any] | None:
    """The JSON object a policy spelled as text holds: JSON text (``{...}``) or the path of a
    JSON file (``PrecisionPolicy.to_json()`` wrote it); ``None`` where ``spec`` is a preset name
    (one of ``presets``, or neither JSON nor a file: the preset check then says which preset
    was meant). JSON that does not parse raises, saying where."""
    if isinstance(spec, str) and (spec in presets or not spec.strip()):
        return None
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        return json_object(spec)
    if _is_file(spec):
        return json_object(Path(spec).expanduser().read_text())
    return None
