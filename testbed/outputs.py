"""Where results go: run folders no other run shares, files written whole or not at all (a
reader, ``testbed report``, a person, a crash's aftermath, sees the previous version or the
new one, never a half-written file)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from testbed.errors import InputError


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all: written beside it, then renamed over it."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary name beside ``path`` to write to; renamed over ``path`` when the block
    ends without an error, removed when it raises: a reader sees the old file or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")  # the suffix tells writers the format
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def new_run_dir(stem: str) -> Path:
    """``runs/<stem>-<timestamp>`` (``runs/<timestamp>`` for an empty stem), created here so
    two runs started in the same second get two folders (the second ``-2``, and so on)."""
    base = Path("runs") / "-".join(x for x in (stem, time.strftime("%Y%m%d-%H%M%S")) if x)
    for k in range(1, 1000):
        path = base if k == 1 else base.with_name(f"{base.name}-{k}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise InputError(f"{base}: 999 run folders of this name already exist")
