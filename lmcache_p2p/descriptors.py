"""File descriptors as a budget: how many a listener may spend on connections, and a spare one
that lets an accept loop refuse a connection when the process has none left.

Imports only the standard library: ``lmcache_server`` uses it on a box without the rest.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import socket

# accept() errors that mean "out of descriptors or kernel memory", not "this one connection broke".
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def descriptor_limit() -> int:
    """The soft RLIMIT_NOFILE: the most descriptors this process may hold."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def open_descriptors() -> int:
    """Descriptors open now (Linux's /proc/self/fd; 0 where there is none)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_cap(configured: int, share: float, reserve: int) -> int:
    """``configured``, lowered so that connections take at most ``share`` of the descriptors free
    now, less ``reserve``: the rest stay for the process's other work (ZMQ sockets, files, outgoing
    connections), so a flood of connections never makes *it* fail with EMFILE. At least 1."""
    free = descriptor_limit() - open_descriptors() - reserve
    return max(1, min(configured, int(free * share)))


class SpareDescriptor:
    """One descriptor held back (on /dev/null) for the moment the process has none left: closing it
    frees one for an ``accept`` whose connection is then closed at once, so a client past the limit
    is refused instead of waiting in the backlog, and the listener stops being readable (no loop
    spinning on a listener it cannot drain)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._take()

    def _take(self) -> None:
        with contextlib.suppress(OSError):
            self._fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def refuse_one(self, listener: socket.socket) -> bool:
        """Accept one pending connection on ``listener`` (non-blocking) and close it; False when
        none could be (no spare, nothing pending, or the freed descriptor was taken meanwhile)."""
        if self._fd is None:
            self._take()
            return False
        os.close(self._fd)
        self._fd = None
        try:
            sock, _ = listener.accept()
        except OSError:
            return False
        else:
            sock.close()
            return True
        finally:
            self._take()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
