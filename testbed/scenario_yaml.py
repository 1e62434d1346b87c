"""Scenario files as YAML: reading them (errors name file and line), ``extends:``, and
finding the line of a field that failed validation (``testbed.scenario.load_scenario``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from protocol.validation import field_errors
from testbed.errors import InputError


def line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at pydantic location ``loc`` (deepest existing node)."""
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == str(key):
                    nxt = v
                    line = k.start_mark.line + 1
                    break
            if nxt is None:
                return line
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def read_yaml(path: Path, what: str = "scenario") -> tuple[yaml.Node | None, dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError as e:
        raise InputError(f"{path}: cannot read {what}: {e.strerror}") from e
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except RecursionError as e:
        raise InputError(f"{path}: invalid YAML: nested too deeply") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise InputError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from e
    if not isinstance(data, dict):
        raise InputError(f"{path}:1: {what} must be a mapping at the top level")
    return node, data


def extended(path: Path, data: dict[str, Any], seen: tuple[Path, ...]) -> dict[str, Any]:
    """``data`` on top of the scenario its ``extends:`` names (recursively)."""
    if (base := data.pop("extends", None)) is None:
        return data
    if not isinstance(base, str) or (base_path := path.parent / base).resolve() in seen:
        raise InputError(f"{path}: extends: expected the path of another scenario file (no cycle), got {base!r}")
    _, base_data = read_yaml(base_path)
    return deep_merge(extended(base_path, _cards_anchored(base_path, base_data), (*seen, base_path.resolve())), data)


def _cards_anchored(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """A base's ``models:`` files named from the base's folder (they are relative to the file
    that names them, wherever the scenario extending it lives)."""
    models = data.get("models")
    if not isinstance(models, dict):
        return data
    here = path.resolve().parent
    return {**data, "models": {k: str(here / v) if isinstance(v, str) else v for k, v in models.items()}}


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def with_card_files(path: Path, data: dict[str, Any], card_type: type[BaseModel]) -> dict[str, Any]:
    """``data`` with each ``models:`` entry that names a file (``qwen3-next: models/qwen3-next.yaml``,
    relative to the scenario) replaced by that file's card, validated there: an error names
    the card's file and line."""
    models = data.get("models")
    if not isinstance(models, dict) or not any(isinstance(v, str) for v in models.values()):
        return data
    cards: dict[str, Any] = {}
    for name, card in models.items():
        if not isinstance(card, str):
            cards[name] = card
            continue
        card_path = path.parent / card
        node, fields = read_yaml(card_path, "model card")
        try:
            card_type.model_validate(fields)
        except ValidationError as e:
            raise InputError("\n".join(f"{card_path}:{line_of(node, err.loc) or '?'}: {err.field or '(top level)'}: "
                                        f"{err.msg}" for err in field_errors(e))) from e
        cards[name] = fields
    return {**data, "models": cards}
