"""How root reaches, reads, writes, removes and runs paths that another account may touch:
a folder opened by descriptors one component at a time, following only links root owns,
and written into only when root owns it and no one else can write it (``open_folder``); a
tree removed at any depth without recursion and without following a link (``remove_tree``);
a component's file read without following a link and only up to a size (``read_nofollow``),
a private file written atomically (``write_private``); a user's Python file (a policy
plugin, a ``--topo``) imported only when root's and writable by no one else
(``trusted_code``, ``import_file``).

Root writes results, caches and kept logs into a checkout an unprivileged account may own
(it ran the simulator there first) and into folders named on the command line, and removes
a run's state, where components wrote folders of their own.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import secrets
import stat
import sys
import traceback
from pathlib import Path
from types import ModuleType

from testbed.errors import InputError
from workers.privilege import open_regular

MAX_LINKS = 40  # as the kernel's own limit on links followed in one path


class UnsafeFolder(InputError):
    """A folder root must not write into (exit 2, naming it and the fix)."""


def _refuse(path: str, why: str, fix: str) -> UnsafeFolder:
    return UnsafeFolder(f"{path}: {why}; root writes only where no other account can plant a link ({fix})")


def open_folder(folder: Path, create: bool = True, owned: bool = True) -> int:
    """A descriptor of ``folder`` (made with its parents if ``create``), reached without
    following a link another account owns; when root and ``owned``, ``folder`` itself must
    be root's and writable by no other account. The caller closes it."""
    root = os.geteuid() == 0
    text = os.fspath(folder)
    parts = [p for p in text.split("/") if p not in ("", ".")]
    cur = os.open("/" if text.startswith("/") else ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = "/" if text.startswith("/") else ""
    hops = 0
    try:
        while parts:
            name = parts.pop(0)
            if name == "..":  # only as written; never reached through a link of another account
                nxt = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
                os.close(cur)
                cur, where = nxt, os.path.join(where, name)
                continue
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=cur)
            st = os.stat(name, dir_fd=cur, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                here = os.fstat(cur)
                if root and (st.st_uid != 0 or (here.st_mode & 0o022 and not here.st_mode & stat.S_ISVTX)):
                    raise _refuse(os.path.join(where, name), f"a link owned by uid {st.st_uid} (or in a folder "
                                  "others can write)", "remove the link, or name the folder it points to")
                hops += 1
                if hops > MAX_LINKS:
                    raise InputError(f"{text}: more than {MAX_LINKS} links")
                target = os.readlink(name, dir_fd=cur)
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
                if target.startswith("/"):
                    os.close(cur)
                    cur, where = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), "/"
                continue
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur)
            os.close(cur)
            cur, where = nxt, os.path.join(where, name)
        if root and owned:
            st = os.fstat(cur)
            if st.st_uid != 0 or st.st_mode & 0o022:
                who = f"owned by uid {st.st_uid}" if st.st_uid != 0 else "writable by other accounts"
                raise _refuse(text, f"a folder {who}",
                              f"chown root: {text} && chmod go-w {text}, or choose a folder that does not exist yet")
        return cur
    except BaseException:
        os.close(cur)
        raise


def remove_tree(path: Path) -> None:
    """Remove ``path`` and everything under it, as far as it can, at any depth and without
    following a link (a link is removed, never what it names). No recursion and two
    descriptors at most: every folder found inside is first moved up to ``path`` itself (a
    component's folder may nest thousands deep: ``shutil.rmtree`` recursed until Python's
    limit and stopped half-way). What cannot be removed stays."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    tag = secrets.token_hex(4)
    moved = 0
    pending: list[str | None] = [None]  # None: ``path`` itself; else a folder moved into it
    try:
        while pending:
            name = pending.pop()
            try:
                fd = top if name is None else os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                                      | os.O_CLOEXEC, dir_fd=top)
            except OSError:
                continue
            try:
                with os.scandir(fd) as entries:
                    children = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
                for child, is_dir in children:
                    if not is_dir:
                        with contextlib.suppress(OSError):
                            os.unlink(child, dir_fd=fd)
                    elif name is None:
                        pending.append(child)
                    else:
                        moved += 1
                        try:
                            os.rename(child, f".removing-{tag}-{moved}", src_dir_fd=fd, dst_dir_fd=top)
                            pending.append(f".removing-{tag}-{moved}")
                        except OSError:
                            continue
            finally:
                if fd != top:
                    os.close(fd)
            if name is not None:
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def trusted_code(path: Path) -> None:
    """Root runs no code another account could have written: ``path`` (a plugin, a
    ``--topo`` file) and its folder must be root's and writable by no one else. Anyone else
    runs what they own. Raises ``UnsafeFolder`` naming the file and the fix."""
    if os.geteuid() != 0:
        return
    for p in (path, path.parent):
        st = os.stat(p)
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise UnsafeFolder(f"{path}: refused as root: {p} is owned by uid {st.st_uid} or writable by other "
                               f"accounts (chown root: {p} && chmod go-w {p}, or use the simulator, unprivileged)")


MAX_READ_BYTES = 2 << 30  # what root reads back of a file a component wrote, at most


def read_nofollow(path: Path, max_bytes: int = MAX_READ_BYTES) -> str:
    """A regular file's text, never through a link (nor a FIFO left to block the reader), and
    never more than ``max_bytes`` of it (a component's file cannot fill root's memory)."""
    with os.fdopen(open_regular(path)) as f:
        if (size := os.fstat(f.fileno()).st_size) > max_bytes:
            raise OSError(f"{path}: {size} bytes, more than the {max_bytes} read back of a component's file")
        return f.read(max_bytes)


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text`` (mode 0600): a fresh temporary file, created
    exclusively and without following links, renamed over it."""
    write_private_bytes(path, text.encode())


def write_readable(path: Path, text: str) -> None:
    """``write_private``, but every account may read it (mode 0644): what root tells an
    unprivileged component through a file in a folder only root writes."""
    write_private_bytes(path, text.encode(), 0o644)


def write_private_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    """``write_private`` for bytes."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def import_file(path: Path, prefix: str) -> ModuleType:
    """Root-checked (``trusted_code``) import of the Python file ``path`` as a module of its
    own, once per process; ``InputError`` naming the file and line where importing it failed."""
    trusted_code(path)
    name = prefix + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    if (module := sys.modules.get(name)) is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: say where it failed
        del sys.modules[name]
        line = e.lineno if isinstance(e, SyntaxError) and e.lineno else next(
            (f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if Path(f.filename) == path), None)
        where = f"{path}:{line}" if line else str(path)
        raise InputError(f"{where}: importing it failed: {type(e).__name__}: {e}") from e
    return module
