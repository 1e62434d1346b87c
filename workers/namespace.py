"""Network namespaces from inside a process: the one primitive a worker process needs.

``setns(CLONE_NEWNET)`` changes the namespace of the calling *thread* only, and a socket
keeps the namespace it was created in. So a process whose modeled instances stand for
different hosts opens each instance's sockets inside that host's namespace (``entered``)
and returns: the instance's KV then leaves from its own address over its own link. The
orchestrator (``testbed/net/netns.py``) builds on the same two functions.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000

libc = ctypes.CDLL(None, use_errno=True)


def setns_fd(fd: int) -> None:
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run the body with the current thread inside namespace ``ns``."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(NETNS_DIR / ns, os.O_RDONLY)
    try:
        setns_fd(target)
        try:
            yield
        finally:
            setns_fd(own)
    finally:
        os.close(target)
        os.close(own)


# Set by a process that dropped its privileges (``workers.privilege``): it can no longer
# enter a namespace, and asks a root child of its own for the socket instead.
_socket_maker: Callable[[str], socket.socket] | None = None


def use_socket_maker(maker: Callable[[str], socket.socket] | None) -> None:
    global _socket_maker
    _socket_maker = maker


def tcp_socket(ns: str | None) -> socket.socket:
    """A non-blocking TCP socket in ``ns`` (``None``: this thread's own namespace)."""
    if ns and _socket_maker is not None:
        return _socket_maker(ns)
    return make_tcp_socket(ns)


def make_tcp_socket(ns: str | None) -> socket.socket:
    """``tcp_socket`` by entering ``ns`` (needs ``CAP_SYS_ADMIN``)."""
    with entered(ns) if ns else contextlib.nullcontext():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock
