"""Layer-wise loads (``use_layerwise``): a step's hits copied into vLLM's blocks layer by layer,
each layer's just before that layer's attention reads it.

vLLM calls the connector's ``wait_for_layer_load(layer)`` on entering every attention layer. On
a GPU, every layer's copy is queued at the start of the step on a load stream of its own, and a
wait only makes the forward pass's stream wait, on the device, for that layer's copy: layer i+1
is copied while layer i computes, and the host never blocks. Elsewhere (CPU engines) a layer is
copied when its wait comes: no overlap, the same order and the same bytes.

A chunk page holds plane after plane (gpu_ops), so a layer's part of every page is one slice,
and one launch per layer copies it for every request of the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from lmcache_p2p import gpu_ops
from lmcache_p2p.cache_engine import LoadPlan


class LayerwiseLoad:
    """One step's loads (``plans``) into ``planes`` (the engine's block planes), by layer:
    ``layer_planes`` maps each attention layer's name to its planes. On a GPU the copies start
    after ``after``, an event on vLLM's stream past which no work of vLLM's touches the blocks
    (a load beside the steps: load_executor.GrantFences), or, without one, after everything
    queued on the current stream so far. ``fence`` orders the load stream after other work that
    may still read the blocks (stores in flight). ``staging`` (a ring of chunk pages in GPU
    memory, gpu_ops.scatter_staged_async) takes a load of every plane at once from host memory
    through the GPU's copy engine instead of the kernel's SMs."""

    def __init__(
        self,
        plans: Sequence[LoadPlan],
        planes: Sequence[torch.Tensor],
        layer_planes: Mapping[str, range],
        fence: Callable[[torch.cuda.Stream], None] | None = None,
        staging: torch.Tensor | None = None,
        after: torch.cuda.Event | None = None,
    ):
        self.plans = list(plans)
        self.planes = list(planes)
        self.layer_planes = dict(layer_planes)
        self._pages = [page for plan in self.plans for page in plan.pages]
        self._blocks = [blocks for plan in self.plans for blocks in plan.chunk_blocks]
        self._skips = [skip for plan in self.plans for skip in plan.skips]
        self._plane_bytes = self._pages[0].numel() // len(self.planes) if self._pages else 0
        self._waited: set[str] = set()
        self._copies: dict[str, gpu_ops.PendingCopy] = {}
        self._host_seconds = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self.staged = False  # host pages came through ``staging`` by the copy engine
        self.queued_at = time.monotonic()  # when the host queued the copies (or made the plan)
        # Recorded at ``queued_at`` on a stream that runs nothing else, so the device reaches it at
        # once: the copies' device times, measured from it, become host times (device_window).
        self._anchor: torch.cuda.Event | None = None
        device = self.planes[0].device
        if device.type == "cuda" and self._pages:
            stream = gpu_ops.side_stream("load", device)
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._anchor.record(gpu_ops.side_stream("clock", device))
            if after is not None:
                stream.wait_event(after)
            else:
                # The blocks may still be read by work queued before this step (a finished
                # request's last decode): the loads go after all of it.
                stream.wait_stream(torch.cuda.current_stream(device))
            if fence is not None:  # and after store copies that may still read the blocks
                fence(stream)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            groups = list(self.layer_planes.values())
            copies: list[gpu_ops.PendingCopy] | None
            whole = groups == [range(len(self.planes))]
            on_host = any(not page.is_cuda for page in self._pages)
            if staging is not None and whole and on_host:
                copy = gpu_ops.scatter_staged_async(
                    self._pages, self.planes, self._blocks, self._skips, stream, staging
                )
                copies = None if copy is None else [copy]
                self.staged = copy is not None
            else:
                copies = gpu_ops.scatter_layers_async(
                    self._pages, self.planes, groups, self._blocks, self._skips, stream
                )
            if copies is not None:  # else (pages the kernels cannot reach) each layer is copied at its wait
                self._copies = dict(zip(self.layer_planes, copies, strict=True))
                end.record(stream)
                self._events = (start, end)

    def _copy(self, layer: range) -> None:
        """One layer's copy, now (no kernels here: a CPU engine, or pages in pageable memory)."""
        lo, hi = layer.start * self._plane_bytes, layer.stop * self._plane_bytes
        pages = [page[lo:hi] for page in self._pages]
        gpu_ops.scatter_chunks(pages, self.planes[layer.start : layer.stop], self._blocks, self._skips)

    def wait(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention: its KV is in the blocks (on a GPU: for the work the
        current stream runs from now on)."""
        layer = self.layer_planes.get(layer_name)
        if layer is None or layer_name in self._waited or not self._pages:
            return
        self._waited.add(layer_name)
        if self._events is not None:
            copy = self._copies.get(layer_name)
            if copy is not None:
                copy.order_before(torch.cuda.current_stream(self.planes[0].device))
            return
        t0 = time.perf_counter()
        self._copy(layer)
        self._host_seconds += time.perf_counter() - t0

    @property
    def on_device(self) -> bool:
        """The copies are queued on the GPU (``done`` says when they end); otherwise each layer is
        copied by the host at its ``wait``."""
        return self._events is not None

    def not_waited(self) -> list[str]:
        """Layers whose attention ran without waiting for their load (none, when vLLM called
        ``wait_for_layer_load`` for every layer): their blocks were not complete when read."""
        if not self._pages:
            return []
        return [name for name in self.layer_planes if name not in self._waited]

    def done(self) -> bool:
        """Every copy finished (the pins may go)."""
        return self._events is None or self._events[1].query()

    def started(self) -> bool:
        """The device has begun the copies (every wait they were queued behind is over)."""
        return self._events is None or self._events[0].query()

    def device_window(self) -> tuple[float, float] | None:
        """When the copies ran on the device, as host times (time.monotonic: their offsets from an
        event the device reached when they were queued); None before they are done, or with no
        copies on a device. Within tens of microseconds: the anchor's launch."""
        if self._events is None or self._anchor is None or not self.done() or not self._anchor.query():
            return None
        start, end = self._events
        return (
            self.queued_at + self._anchor.elapsed_time(start) / 1e3,
            self.queued_at + self._anchor.elapsed_time(end) / 1e3,
        )

    def order_before_current(self) -> None:
        """Make what the current stream runs from now on wait (on the device) for every copy: for
        the work after a forward pass that skipped a wait (a recompute, the blocks' next owner)."""
        if self._events is not None:
            torch.cuda.current_stream(self.planes[0].device).wait_event(self._events[1])

    def synchronize(self) -> None:
        """Wait (on the host) until every copy has finished."""
        if self._events is not None:
            self._events[1].synchronize()

    @property
    def seconds(self) -> float:
        """The copies' time: on a GPU from the first copy's start to the last one's end, on the
        device (call once done); elsewhere the host's time in them."""
        if self._events is None:
            return self._host_seconds
        start, end = self._events
        return start.elapsed_time(end) / 1e3


def drain(device: torch.device) -> None:
    """Wait until every copy queued on ``device``'s load stream is done (a load that failed to
    start part-way: its pins may go only then)."""
    gpu_ops.side_stream("load", device).synchronize()
