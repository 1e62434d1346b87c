"""One way to say what failed validation, for every boundary: a scenario line, a trace line,
a fault or policy spec, a topology, an HTTP body, a control message, a KV frame."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError


@dataclass(frozen=True)
class FieldError:
    loc: tuple[str | int, ...]  # where in the input, as pydantic gives it
    msg: str  # what was wrong, without pydantic's "Value error, " prefix

    @property
    def field(self) -> str:
        return ".".join(str(p) for p in self.loc)


def field_errors(e: ValidationError) -> list[FieldError]:
    """Every failing field of ``e``, in order; a missing one says so plainly."""
    return [FieldError(tuple(err["loc"]), "missing field" if err["type"] == "missing"
                       else err["msg"].removeprefix("Value error, ")) for err in e.errors()]


def first_error(e: ValidationError, empty: str) -> str:
    """The first failing field as ``field: message`` (``empty`` names a whole-input error)."""
    fe = field_errors(e)[0]
    return f"{fe.field or empty}: {fe.msg}"


def one_line(e: ValidationError, empty: str = "message") -> str:
    """Every failing field in one line: ``field: message; field: message``."""
    return "; ".join(f"{fe.field or empty}: {fe.msg}" for fe in field_errors(e))
