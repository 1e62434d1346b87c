"""Reading a trace's lines, bounded: every reader's JSON lines (non-finite numbers, nesting
and endless integers refused at the line) and the bounds every length and time is held to."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from pydantic import AllowInfNan, BaseModel, Field, StrictFloat, StrictInt, ValidationError

from protocol.messages import MAX_PROMPT_TOKENS
from testbed.traces.line_errors import from_validation, line_error, read_lines

# Bounds every reader applies at the line: a number outside them is a clear error naming the
# line and field, never an overflow, a run of ten thousand years or a prompt no worker holds.
MAX_TOKENS = MAX_PROMPT_TOKENS  # a length of tokens (input, output, prefix, a turn's)
MAX_SECONDS = 1e9  # a time or delay in seconds (~31 years)
Number = Annotated[StrictInt | StrictFloat, AllowInfNan(False)]
Seconds = Annotated[Number, Field(ge=0, le=MAX_SECONDS)]
Tokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)]


class _NotFinite(ValueError):
    pass


def _finite_only(name: str) -> float:
    raise _NotFinite(f"{name} is not a number")


def json_value(line: str) -> Any:
    """One line of JSON; raises ValueError saying why it is not (non-finite numbers, nesting
    past what a parser should follow, integers of thousands of digits included)."""

    try:
        return json.loads(line, parse_constant=_finite_only)
    except (json.JSONDecodeError, _NotFinite) as e:
        raise ValueError(f"not valid JSON: {e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError)
                         else str(e)) from e
    except RecursionError as e:
        raise ValueError("nested too deeply") from e
    except ValueError as e:  # an integer of more digits than Python converts (4,300)
        raise ValueError(f"a number too long to read ({str(e).split(':')[0]})") from e


def json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for i, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        try:
            obj = json_value(line)
        except ValueError as e:
            raise line_error(path, i, "(line)", str(e)) from e
        if not isinstance(obj, dict):
            raise line_error(path, i, "(line)", "expected a JSON object")
        yield i, obj


def parse_line(model: type[BaseModel], path: Path, line: int, obj: dict[str, Any]) -> Any:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation(path, line, e) from e


def csv_rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """A CSV trace's rows with their line numbers, after checking that its header names
    ``columns`` (others are ignored)."""
    reader = csv.DictReader(read_lines(path))
    missing = [c for c in columns if c not in (reader.fieldnames or [])]
    if missing:
        raise line_error(path, 1, "header", f"missing column(s) {', '.join(missing)} (expected {', '.join(columns)})")
    for row in reader:
        yield reader.line_num, row


def csv_int(path: Path, line: int, row: dict[str, str], col: str, lo: int, hi: int) -> int:
    """Column ``col`` of a row as an integer in ``lo..hi`` (an error naming line and column)."""
    raw = (row.get(col) or "").strip()
    try:
        value = int(raw) if len(raw) <= 20 else None
    except ValueError:
        value = None
    if value is None:
        raise line_error(path, line, col, f"expected an integer, got {raw[:40]!r}")
    if not lo <= value <= hi:
        raise line_error(path, line, col, f"must be in {lo}..{hi}, got {value}")
    return value


def csv_seconds(path: Path, line: int, row: dict[str, str], col: str, scale: float = 1.0) -> float:
    """Column ``col`` as a finite, non-negative time in seconds (the column's unit x ``scale``)."""
    raw = (row.get(col) or "").strip()
    try:
        value = float(raw[:64]) * scale
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_SECONDS:  # NaN and infinities fail too
        raise line_error(path, line, col, f"expected seconds in 0..{MAX_SECONDS:g}, got {raw[:40]!r}")
    return value
