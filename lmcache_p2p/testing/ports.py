"""Free TCP ports for the servers tests, benchmarks and the fleet harness start."""

from __future__ import annotations

import os
import random
import socket


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()  # never twice in one process: a port may not be bound yet


def free_ports(n: int) -> list[int]:
    """``n`` ports that bind now, below the kernel's ephemeral range: a port the kernel hands
    out (bind to 0) can be taken again by any outgoing connection before a test's process binds
    it, which made engines fail with "Address already in use" now and then."""
    rng = random.Random()
    high = _ephemeral_low()
    low = min(20000, high // 2)
    # pytest-xdist workers are separate processes: each takes its own slice of the range, so two
    # never hand out the same port (one could bind it between the other's check and its use).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    if workers > 1:
        width = (high - low) // workers
        low, high = low + index * width, low + (index + 1) * width
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))  # every interface, as the engines' ZMQ sockets bind
            except OSError:
                continue
        _handed_out.add(port)
        ports.append(port)
    return ports
