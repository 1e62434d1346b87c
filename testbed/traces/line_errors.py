"""Turning a pydantic error on one trace line into ``file:line: field: message``."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

from pydantic import ValidationError

from protocol.validation import first_error
from testbed.errors import InputError


def line_error(path: Path, line: int, field: str, msg: str) -> InputError:
    return InputError(f"{path}:{line}: {field}: {msg}")


def from_validation(path: Path, line: int, e: ValidationError) -> InputError:
    return InputError(f"{path}:{line}: {first_error(e, '(line)')}")


def read_lines(path: Path) -> list[str]:
    """A text file's lines; a ``.gz`` one decompressed (as traces are published)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt") as f:
                return f.read().splitlines()
        return path.read_text().splitlines()
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not a text file ({e.reason} at byte {e.start})") from e
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise InputError(f"{path}: not a whole gzip file ({e})") from e
