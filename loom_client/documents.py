"""Run-config documents on disk (YAML or JSON) and `--set path=value` changes to them."""

import copy
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


class DocumentError(ValueError):
    """A file or a `--set` that cannot give a config document; the message names it and says what is wrong."""


def load_document(path: Path) -> dict[str, Any]:
    """A run-config document from a YAML or a JSON file (JSON is YAML too, but its own parser says more
    precisely where a JSON file is broken)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DocumentError(f"{path}: cannot read it: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise DocumentError(f"{path}: not UTF-8 text: {error}") from None
    try:
        document = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as error:
        raise DocumentError(f"{path}: invalid JSON: {error}") from None
    except yaml.YAMLError as error:
        raise DocumentError(f"{path}: invalid YAML: {error}") from None
    if not isinstance(document, dict):
        found = "nothing" if document is None else f"a {type(document).__name__}"
        raise DocumentError(
            f"{path}: must hold a run config (a mapping of sections such as model:, parallel:), not {found}"
        )
    try:
        # YAML has dates, sets and binary, which a JSON request cannot carry.
        json.dumps(document)
    except (TypeError, ValueError) as error:
        raise DocumentError(f"{path}: holds a value JSON cannot carry ({error}); quote it") from None
    return document


def parse_override(text: str) -> tuple[str, Any]:
    """ "parallel.tp=2" → ("parallel.tp", 2): the value is read as YAML, so 2 is a number, true a boolean,
    null nothing, and anything else (bf16) text; quote it ("'2'") to keep a number as text. 1e-4 is a
    number too, though YAML 1.1 (PyYAML's) reads a float only with a dot in it."""
    path, equals, raw = text.partition("=")
    path = path.strip()
    if not equals:
        raise DocumentError(f"--set {text!r}: write it as PATH=VALUE, such as parallel.tp=2")
    if not path or any(not part.strip() for part in path.split(".")):
        raise DocumentError(f"--set {text!r}: {path!r} is not a dotted path of field names, such as parallel.tp")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        raise DocumentError(f"--set {text!r}: the value is not YAML: {error}") from None
    if isinstance(value, str) and value == raw.strip():
        value = _as_finite_number(value)
    return path, value


def _as_finite_number(text: str) -> Any:
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def parse_overrides(texts: list[str]) -> dict[str, Any]:
    return dict(parse_override(text) for text in texts)


def with_overrides(document: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `document` with each dotted path set to its value, the sections on the way created as needed."""
    changed = copy.deepcopy(dict(document))
    for path, value in overrides.items():
        *sections, field = path.split(".")
        target = changed
        for depth, name in enumerate(sections):
            target = target.setdefault(name, {})
            if not isinstance(target, dict):
                above = ".".join(sections[: depth + 1])
                raise DocumentError(f"--set {path}: {above} is {target!r}, not a section with fields to set")
        target[field] = value
    return changed
