"""Turning a pydantic error on one trace line into ``file:line: field: message``."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from protocol.validation import first_error
from testbed.errors import InputError


def line_error(path: Path, line: int, field: str, msg: str) -> InputError:
    return InputError(f"{path}:{line}: {field}: {msg}")


def from_validation(path: Path, line: int, e: ValidationError) -> InputError:
    return InputError(f"{path}:{line}: {first_error(e, '(line)')}")


def read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not a text file ({e.reason} at byte {e.start})") from e
