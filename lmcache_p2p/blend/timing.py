"""Where a blend's time goes: phases timed on the device and on the host, for its log line.

A blend queues hundreds of small kernels; timing it with the host's clock alone says when the
host finished queuing, not what the GPU spent. :class:`PhaseTimer` records a CUDA event beside
the host's clock at each phase boundary (on a CPU both are the host's clock) and sums, per phase
name, the device's time and the host's. Events cost no synchronisation: :meth:`summary` waits
once, at the end, where the blend waits anyway (its blocks must be written before the step).
A phase whose host time is close to its device time is bound by the host (launches, Python);
one whose device time dominates is bound by the kernels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class PhaseTimer:
    device: torch.device
    _marks: list[tuple[str, float, object]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._cuda = self.device.type == "cuda"
        self._marks.append(("", time.perf_counter(), self._event()))

    def _event(self) -> object:
        if not self._cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self, phase: str) -> None:
        """Ends ``phase`` (the work queued since the previous mark); repeated names add up."""
        self._marks.append((phase, time.perf_counter(), self._event()))

    def summary(self) -> dict[str, tuple[float, float]]:
        """Per phase, in order of first appearance: (device ms, host ms). Waits for the device."""
        if self._cuda:
            self._marks[-1][2].synchronize()  # type: ignore[attr-defined]
        out: dict[str, tuple[float, float]] = {}
        pairs = zip(self._marks, self._marks[1:], strict=False)
        for (_, host_before, ev_before), (name, host_after, ev_after) in pairs:
            host_ms = (host_after - host_before) * 1e3
            device_ms = ev_before.elapsed_time(ev_after) if self._cuda else host_ms  # type: ignore[attr-defined]
            dev, host = out.get(name, (0.0, 0.0))
            out[name] = (dev + device_ms, host + host_ms)
        return out

    def describe(self) -> str:
        """``phase D ms`` per phase (device time), and the host's total beside the device's."""
        phases = self.summary()
        parts = ", ".join(f"{name} {dev:.1f}" for name, (dev, _) in phases.items())
        device = sum(d for d, _ in phases.values())
        host = sum(h for _, h in phases.values())
        return f"{parts} ms; device {device:.1f} ms, host {host:.1f} ms"


class NoTimer:
    """Stands in for a PhaseTimer where nobody reads the phases (the per-segment stores)."""

    def mark(self, phase: str) -> None:
        pass
