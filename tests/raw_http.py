"""HTTP at the socket: a response read off a raw socket, and a process's resident memory, for the
tests that send bodies no client library would (test_api_security.py, test_router.py)."""

from __future__ import annotations

import socket


def peak_rss(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) in bytes: the process's peak and current resident memory."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmHWM"], fields["VmRSS"]


def read_response(sock: socket.socket, timeout: float) -> tuple[int, bytes]:
    """One HTTP/1.1 response (status, body) with a Content-Length, read off a raw socket."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body
