"""Where results go: run folders no other run shares, files written whole or not at all (a
reader, ``testbed report``, a person, a crash's aftermath, sees the previous version or the
new one, never a half-written file), and never through what another account controls.

Root writes results, caches and kept logs into a checkout that an unprivileged account may
own (it ran the simulator there first) and into folders named on the command line. So every
write here:

* reaches its folder by descriptors, one component at a time, following only links that
  root owns (``open_folder``): a link another account planted anywhere on the way is refused;
  a folder renamed away meanwhile is still the one written into;
* when root, writes only into a folder that root owns and no other account can write (an
  error naming the folder and the fix otherwise): nobody else can plant a name in it;
* goes through a temporary created exclusively under a random name (``O_CREAT | O_EXCL |
  O_NOFOLLOW``), handed to the writer (pandas, matplotlib) as a path through the folder's
  descriptor, then renamed over the file within that folder.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from testbed.errors import InputError
from testbed.root_paths import UnsafeFolder, open_folder

__all__ = ["UnsafeFolder", "atomic_path", "new_run_dir", "open_folder", "write_atomic"]

def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all: written beside it, then renamed over it."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_path(path: Path, mode: int = 0o644) -> Iterator[Path]:
    """A temporary beside ``path`` to write to (created exclusively under a random name, in
    a folder reached as ``open_folder`` does); renamed over ``path`` when the block ends
    without an error, removed when it raises: a reader sees the old file or the new."""
    folder = open_folder(path.parent)
    # The suffix tells writers the format; the name is no one's to guess.
    name = f".{path.stem}.{secrets.token_hex(8)}.tmp{path.suffix}"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=folder)
        os.fchmod(fd, mode)  # whatever the umask
        os.close(fd)
        try:
            yield Path(f"/proc/self/fd/{folder}/{name}")  # through the folder's descriptor, not its path
            os.replace(name, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=folder)
    finally:
        os.close(folder)


def new_run_dir(stem: str, under: Path = Path("runs")) -> Path:
    """``runs/<stem>-<timestamp>`` (``runs/<timestamp>`` for an empty stem), created here so
    two runs started in the same second get two folders (the second ``-2``, and so on); a
    new folder of this process's account, whoever made ``runs/``."""
    name = "-".join(x for x in (stem, time.strftime("%Y%m%d-%H%M%S")) if x)
    parent = open_folder(under, owned=False)  # runs/ may be another account's: the new folder is ours
    try:
        for k in range(1, 1000):
            leaf = name if k == 1 else f"{name}-{k}"
            try:
                os.mkdir(leaf, 0o755, dir_fd=parent)
            except FileExistsError:
                continue
            fd = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            try:
                os.fchmod(fd, 0o755)  # whatever the umask
            finally:
                os.close(fd)
            return under / leaf
    finally:
        os.close(parent)
    raise InputError(f"{under / name}: 999 run folders of this name already exist")
