"""Measuring a process from the outside, for tests and benchmarks: its CPU time from /proc,
latency spreads, and floods of idle connections against a listener."""

from __future__ import annotations

import os
import socket
import statistics

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds the process has used (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def spread_ms(samples: list[float]) -> dict:
    """``n``, ``p50_ms``, ``p99_ms``, ``max_ms`` of millisecond samples (``{"n": 0}`` for none)."""
    samples = sorted(samples)
    if not samples:
        return {"n": 0}
    return {
        "n": len(samples),
        "p50_ms": round(statistics.median(samples), 2),
        "p99_ms": round(samples[min(len(samples) - 1, int(0.99 * len(samples)))], 2),
        "max_ms": round(samples[-1], 2),
    }


def idle_connections(port: int, n: int) -> list[socket.socket]:
    """``n`` connections to 127.0.0.1:``port`` that never send a byte (the kernel's backlog
    takes what the listener does not accept)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    return socks


def closed_by_server(socks: list[socket.socket]) -> int:
    """How many of :func:`idle_connections`' sockets the listener has closed or refused."""
    closed = 0
    for s in socks:
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:  # reset, or never connected: the server is not holding it
            closed += 1
    return closed


def footprint(pids: list[int]) -> dict:
    """Open descriptors, threads and resident MiB summed over ``pids`` (/proc; a process gone
    meanwhile counts nothing), with how many of them were read."""
    fds = threads = rss_pages = read = 0
    for pid in pids:
        try:
            n_fds = len(os.listdir(f"/proc/{pid}/fd"))
            with open(f"/proc/{pid}/status") as f:
                n_threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
            with open(f"/proc/{pid}/statm") as f:
                pages = int(f.read().split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        fds, threads, rss_pages, read = fds + n_fds, threads + n_threads, rss_pages + pages, read + 1
    rss_mib = rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    return {"processes": read, "fds": fds, "threads": threads, "rss_mib": round(rss_mib, 1)}


def process_group(pgid: int) -> list[int]:
    """The pids whose process group is ``pgid`` (an engine's API server, engine core, workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # pgrp; a zombie holds nothing
            pids.append(int(entry))
    return pids
