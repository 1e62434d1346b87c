"""Step times measured on a real accelerator: what a device profile is fitted to.

A CSV with a header row; ``#`` lines are comments (provenance). Columns:

* ``kind``: ``prefill`` (one pass over ``batch`` sequences of ``tokens`` new tokens after
  ``context`` cached ones: a time to first token at batch 1), ``decode`` (``tokens`` decode
  steps of ``batch`` requests starting at ``context``), or ``run`` (a static batch: ``batch``
  requests of ``context`` input tokens prefilled, then decoded to ``tokens`` output tokens;
  what throughput tables report as ``batch x tokens / (out tok/s)``);
* ``tokens``, ``context``, ``batch``, ``devices`` (tensor-parallel instance), ``ms``;
* optional ``dtype_bytes`` (weights and KV of the run; default the model card's) and
  ``source`` (where the number comes from).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from testbed.traces.line_errors import line_error, read_lines

KINDS = ("prefill", "decode", "run")
REQUIRED = ("kind", "tokens", "context", "batch", "devices", "ms")
OPTIONAL = ("dtype_bytes", "source")


@dataclass(frozen=True)
class Measurement:
    kind: str
    tokens: int
    context: int
    batch: int
    devices: int
    ms: float
    dtype_bytes: int | None = None
    source: str = ""
    line: int = 0


def load_measurements(path: str | Path) -> list[Measurement]:
    """Read and check a measurement CSV; errors name the file, line and column."""
    path = Path(path)
    lines = read_lines(path)
    numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#")]
    if not numbered:
        raise line_error(path, 1, "(file)", "no header row and no measurements")
    header_line, header = numbered[0]
    columns = [c.strip() for c in next(csv.reader([header]))]
    missing = [c for c in REQUIRED if c not in columns]
    if missing:
        raise line_error(path, header_line, missing[0], f"missing column (need {', '.join(REQUIRED)})")
    unknown = [c for c in columns if c not in REQUIRED + OPTIONAL]
    if unknown:
        raise line_error(path, header_line, unknown[0], f"unknown column (known: {', '.join(REQUIRED + OPTIONAL)})")
    out = []
    for line, text in numbered[1:]:
        values = next(csv.reader(io.StringIO(text)))
        if len(values) != len(columns):
            raise line_error(path, line, "(row)", f"{len(values)} values for {len(columns)} columns")
        row = dict(zip(columns, (v.strip() for v in values), strict=True))
        out.append(_measurement(path, line, row))
    if not out:
        raise line_error(path, header_line, "(file)", "a header and no measurements")
    return out


def _measurement(path: Path, line: int, row: dict[str, str]) -> Measurement:
    kind = row["kind"]
    if kind not in KINDS:
        raise line_error(path, line, "kind", f"{kind!r} is not one of {', '.join(KINDS)}")

    def integer(name: str, low: int) -> int:
        try:
            v = int(row[name])
        except ValueError:
            raise line_error(path, line, name, f"{row[name]!r} is not an integer") from None
        if v < low:
            raise line_error(path, line, name, f"must be >= {low}")
        return v

    try:
        ms = float(row["ms"])
    except ValueError:
        raise line_error(path, line, "ms", f"{row['ms']!r} is not a number") from None
    if not ms > 0 or ms == float("inf"):
        raise line_error(path, line, "ms", "must be a positive, finite number of milliseconds")
    dtype = integer("dtype_bytes", 1) if row.get("dtype_bytes") else None
    if dtype is not None and dtype > 8:
        raise line_error(path, line, "dtype_bytes", "must be <= 8")
    m = Measurement(kind=kind, tokens=integer("tokens", 1), context=integer("context", 0), batch=integer("batch", 1),
                    devices=integer("devices", 1), ms=ms, dtype_bytes=dtype, source=row.get("source", ""), line=line)
    if m.kind == "run" and m.context < 1:
        raise line_error(path, line, "context", "a run needs its input length (>= 1)")
    return m
