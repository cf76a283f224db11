"""The nixl channel: the holder WRITEs its pool pages into the requester's pool pages.

Each process registers its whole CPU page pool with one NIXL agent (UCX backend) once, and
prepares a descriptor list with one entry per page, so a transfer is "pages [3, 9] of mine to
pages [0, 1] of yours" by index: no per-transfer registration. A requester sends its agent
metadata and pool geometry once per holder (the hello on p2p_init); the holder adds it as a
remote agent and prepares the requester's page list.

Every NIXL call runs on one dedicated thread: the agent is used from one thread only (no reliance
on NIXL's thread-sync modes), a large transfer that completes inside ``transfer()`` never blocks
the worker's event loop, and completion is polled with a growing sleep rather than a busy spin.

Between two processes of one host that both have GPU staging (``nixl_buffer_device``, on by
default where CUDA is), the holder writes through VRAM instead (see gpu_staging): NIXL moves
host memory between processes at ~5 GB/s but GPU memory at over 1 TB/s over cuda_ipc. A
requester on a staged session sends its receive slots along with its pages, and the holder
falls back to the pages if the staged write fails.

With a GPU tier (``local_gpu``) its pages are registered beside the staging slots, and both
ends use them: a holder writes a chunk its GPU tier holds straight from there (no copy from host
memory first), and a requester asks for a pull to be written into GPU tier pages it reserved
instead of receive slots, where the engine loads it from device to device (the pages are then
written back to the CPU tier behind the request: VramLanding.commit_landed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from lmcache_p2p.protocol import ChannelHello
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.storage.gpu_tier import GpuTier
from lmcache_p2p.storage.memory import PagePool
from lmcache_p2p.transfer import NIXL_FIX
from lmcache_p2p.transfer.base import TransferError, Transport, check_hello_bounds
from lmcache_p2p.transfer.gpu_staging import GpuStaging

logger = logging.getLogger(__name__)

_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.005


@dataclass
class _RemotePool:
    agent_name: str
    instance: tuple[str, int]
    pages: object  # NIXL prepared descriptor list handle
    num_pages: int
    slots: object = None  # its GPU receive slots then its GPU tier pages (prepared list), when staged
    num_slots: int = 0


def _page_descs(base: int, num_pages: int, page_bytes: int, device: int = 0) -> np.ndarray:
    descs = np.zeros((num_pages, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_pages, dtype=np.uint64) * np.uint64(page_bytes)
    descs[:, 1] = page_bytes
    descs[:, 2] = device
    return descs


@functools.cache
def host_id() -> str:
    """This host as cuda_ipc sees it: the name alone could repeat across machines."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


# NIXL's progress thread drives UCX for transfers this agent is the target of (a holder WRITEs
# into our pages; over UCX's tcp transport that needs our side's progress), so it must run. NIXL's
# Python API starts it with no pause between rounds, and an idle agent then burns a whole core:
# on a small host, next to a CPU engine, that starved the holder's own P2P thread (hellos and pulls
# past their timeouts). A short pause (config nixl_progress_delay_us, default 200 us) keeps it
# responsive: a 32 MiB chunk takes ~10 ms at 3 GB/s.


@contextlib.contextmanager
def _progress_thread_delay(delay_us: int):
    """Build NIXL agents with ``pthrDelay = delay_us``: nixl_agent hard-codes 0 before handing its
    config to the bindings, so the bindings' constructor is wrapped for the duration."""
    from nixl._api import nixlBind

    real = nixlBind.nixlAgent

    def make_agent(name, config):
        config.pthrDelay = delay_us
        return real(name, config)

    nixlBind.nixlAgent = make_agent
    try:
        yield
    finally:
        nixlBind.nixlAgent = real


class NixlTransport(Transport):
    name = "nixl"

    def __init__(
        self,
        pool: PagePool,
        session: str,
        progress_delay_us: int = 200,
        staging: GpuStaging | None = None,
        gpu_tier: GpuTier | None = None,
    ):
        super().__init__(pool, session)
        self.staging = staging
        self.gpu_tier = gpu_tier if staging is not None else None  # reached through staged sessions only
        self._gpu_tier_registration = None
        if pool.num_pages == 0:
            raise TransferError("the CPU page pool is empty: nothing to register with NIXL")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except (ImportError, OSError) as e:  # OSError: a library the package loads is missing
            raise TransferError(f"NIXL cannot be imported here ({e}); fix: {NIXL_FIX}") from None
        # UCX's cuda transports work in the calling thread's CUDA context: make it current there.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="lmcache-nixl", initializer=self._bind_device)
        try:
            with _progress_thread_delay(progress_delay_us):
                self.agent = nixl_agent(session, nixl_agent_config(backends=["UCX"]))
        except Exception as e:
            raise TransferError(f"NIXL agent could not start: {e}") from None
        if "UCX" not in self.agent.backends:
            raise TransferError(f"NIXL has no UCX backend here; fix: {NIXL_FIX}")
        self.base = pool.buffer.data_ptr()
        size = pool.num_pages * pool.page_bytes
        t0 = time.perf_counter()
        self._registered = self.agent.register_memory([(self.base, size, 0, "")], "DRAM")
        self._local_pages = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _page_descs(self.base, pool.num_pages, pool.page_bytes), "DRAM"
        )
        self._staged_registration = self._local_slots = None
        if staging is not None:
            try:
                self._thread.submit(self._register_staging).result()
            except Exception as e:
                logger.warning(
                    "NIXL cannot register the GPU staging buffer on %s (%s); pulls go pool to pool", staging.device, e
                )
                staging.close()
                self.staging = staging = None
                self.gpu_tier = None
        self._metadata = self.agent.get_agent_metadata()
        self._peers: dict[str, _RemotePool] = {}
        logger.info(
            "NIXL agent %s: registered %d pages x %.2f MiB (%.2f GiB)%s in %.1f ms",
            session,
            pool.num_pages,
            pool.page_bytes / 2**20,
            size / 2**30,
            (f" and {staging.num_slots} GPU staging slots on {staging.device}" if staging else "")
            + (f" and {self.gpu_tier.pool.num_pages} GPU tier pages" if self.gpu_tier else ""),
            (time.perf_counter() - t0) * 1e3,
        )

    @property
    def _staged(self) -> GpuStaging:
        """The GPU staging buffer, on the paths that only a staged session takes."""
        if self.staging is None:
            raise RuntimeError("NIXL transport: a staged transfer without GPU staging")
        return self.staging

    def _bind_device(self) -> None:
        if self.staging is not None:
            torch.cuda.set_device(self.staging.device)

    def _register_staging(self) -> None:
        """Register the staging slots (and the GPU tier's pages after them, local index
        ``num_slots + page``) as one VRAM descriptor list."""
        staging = self._staged
        dev = staging.device_index
        self._staged_registration = self.agent.register_memory(
            [(staging.base, staging.num_slots * staging.page_bytes, dev, "")], "VRAM"
        )
        descs = _page_descs(staging.base, staging.num_slots, staging.page_bytes, dev)
        tier = self.gpu_tier
        if tier is not None:
            try:
                self._gpu_tier_registration = self.agent.register_memory(
                    [(tier.pool.buffer.data_ptr(), tier.pool.num_pages * tier.pool.page_bytes, dev, "")], "VRAM"
                )
                descs = np.concatenate(
                    [descs, _page_descs(tier.pool.buffer.data_ptr(), tier.pool.num_pages, tier.pool.page_bytes, dev)]
                )
            except Exception as e:
                logger.warning("NIXL cannot register the GPU tier (%s); peers reach only its CPU copies", e)
                self.gpu_tier = None
        self._local_slots = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, "VRAM")

    def _tier_index(self, chunk: PinnedChunk) -> int | None:
        """``chunk``'s GPU tier page as a local staged descriptor index, or None (host memory)."""
        tier = self.gpu_tier
        if tier is None or not chunk.data.is_cuda:
            return None
        offset = chunk.data.data_ptr() - tier.pool.buffer.data_ptr()
        if not 0 <= offset < tier.pool.num_pages * tier.pool.page_bytes or offset % tier.pool.page_bytes:
            return None
        return self._staged.num_slots + offset // tier.pool.page_bytes

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- requester side --------------------------------------------------------------------------

    def hello(self, instance_id: str, rank: int, fingerprint: int) -> ChannelHello:
        hello = super().hello(instance_id, rank, fingerprint)
        hello.agent_metadata = self._metadata
        hello.pool_base = self.base
        if self.staging is not None:
            hello.host_id = host_id()
            hello.staging_base = self.staging.base
            hello.staging_slots = self.staging.receiving.capacity
            hello.staging_device = self.staging.device_index
            if self.gpu_tier is not None:
                hello.gpu_tier_base = self.gpu_tier.pool.buffer.data_ptr()
                hello.gpu_tier_pages = self.gpu_tier.pool.num_pages
        return hello

    def max_batch(self, into_gpu_tier: bool = False) -> int | None:
        if self.staging is None:
            return None
        if into_gpu_tier and self.gpu_tier is not None:
            # Landing in GPU tier pages needs no receive slot: a request may carry up to what
            # _reserve_tier_pages grants, so a document can be one request.
            return max(self.staging.receiving.capacity, self._tier_batch_pages())
        return self.staging.receiving.capacity

    async def prepare(self, pages: Sequence[int], staged: bool, timeout: float, gpu_tier: bool = False) -> list[int]:
        self.pool.make_resident(pages)  # the holder may write the pages after all
        if not staged or self.staging is None:
            return []
        tier_pages = self._reserve_tier_pages(len(pages)) if gpu_tier else []
        if tier_pages:
            return [self.staging.receiving.capacity + p for p in tier_pages]
        if len(pages) > self.staging.receiving.capacity:
            return []  # sized for the GPU tier, which had no room: the holder writes our pages
        return await self.staging.receiving.take(len(pages), timeout, whole=True)

    def _tier_batch_pages(self) -> int:
        """The most GPU tier pages one batch may land in: half the tier, never all of it."""
        return self.gpu_tier.pool.num_pages // 2 if self.gpu_tier is not None else 0

    def _reserve_tier_pages(self, count: int) -> list[int]:
        """``count`` GPU tier pages for a pull to land in (evicting the tier's least recently
        used chunks), or none at all: a batch lands in one place."""
        tier = self.gpu_tier
        if tier is None or count > self._tier_batch_pages():
            return []
        taken: list[int] = []
        for _ in range(count):
            page = tier.allocate()
            if page is None:
                for p in taken:
                    tier.pool.free(p)
                return []
            taken.append(page)
        return taken

    def gpu_landing(self, slots: Sequence[int]) -> list[int]:
        if self.gpu_tier is None or not slots:
            return []
        first = self._staged.receiving.capacity
        return [s - first for s in slots] if slots[0] >= first else []

    async def land(self, frames: list, pages: Sequence[int], slots: Sequence[int]) -> None:
        if slots and not self.gpu_landing(slots):  # in GPU tier pages, the bytes are where they stay
            await self._staged.from_slots(slots, [self.pool.page(p) for p in pages])

    def release(self, slots: Sequence[int]) -> None:
        if not slots:
            return
        tier_pages = self.gpu_landing(slots)
        if tier_pages:
            assert self.gpu_tier is not None
            for page in tier_pages:
                self.gpu_tier.pool.free(page)
        else:
            self._staged.receiving.give(slots)

    # -- holder side -----------------------------------------------------------------------------

    async def accept(self, hello: ChannelHello) -> bool:
        check_hello_bounds(hello)  # before anything is sized by its fields
        if hello.session in self._peers:
            return self._peers[hello.session].slots is not None
        if hello.page_bytes != self.pool.page_bytes:
            raise TransferError(f"requester pages are {hello.page_bytes} bytes, ours {self.pool.page_bytes}")
        if not hello.agent_metadata or hello.num_pages <= 0:
            raise TransferError("nixl hello without agent metadata or pool pages")
        instance = (hello.instance_id, hello.rank)
        for session, peer in list(self._peers.items()):
            if peer.instance == instance:  # that requester restarted: forget its old agent
                del self._peers[session]
                await self._call(self._forget, peer)
        name = await self._call(self.agent.add_remote_agent, hello.agent_metadata)
        if isinstance(name, bytes):
            name = name.decode()
        pages = await self._call(
            self.agent.prep_xfer_dlist, name, _page_descs(hello.pool_base, hello.num_pages, hello.page_bytes), "DRAM"
        )
        peer = self._peers[hello.session] = _RemotePool(name, instance, pages, hello.num_pages)
        if self.staging is not None and hello.staging_slots > 0 and hello.host_id == host_id():
            descs = _page_descs(hello.staging_base, hello.staging_slots, hello.page_bytes, hello.staging_device)
            if hello.gpu_tier_pages > 0:
                descs = np.concatenate(
                    [
                        descs,
                        _page_descs(hello.gpu_tier_base, hello.gpu_tier_pages, hello.page_bytes, hello.staging_device),
                    ]
                )
            peer.slots = await self._call(self.agent.prep_xfer_dlist, name, descs, "VRAM")
            peer.num_slots = len(descs)
        logger.info(
            "NIXL session from %s rank %d (%s, %d pages%s)",
            hello.instance_id,
            hello.rank,
            name,
            hello.num_pages,
            f", staged through {hello.staging_slots} GPU slots and {hello.gpu_tier_pages} GPU tier pages"
            if peer.slots is not None
            else "",
        )
        return peer.slots is not None

    def _forget(self, peer: _RemotePool) -> None:
        try:
            self.agent.release_dlist_handle(peer.pages)
            if peer.slots is not None:
                self.agent.release_dlist_handle(peer.slots)
            self.agent.remove_remote_agent(peer.agent_name)
        except Exception as e:
            logger.debug("forgetting NIXL peer %s: %s", peer.agent_name, e)

    def addressable(self, chunk: PinnedChunk) -> bool:
        if self._tier_index(chunk) is not None:
            return True
        offset = chunk.data.data_ptr() - self.base
        return (
            not chunk.data.is_cuda
            and 0 <= offset < self.pool.num_pages * self.pool.page_bytes
            and offset % self.pool.page_bytes == 0
        )

    def reads_gpu_tier(self, session: str) -> bool:
        peer = self._peers.get(session)
        return self.gpu_tier is not None and peer is not None and peer.slots is not None

    async def send(
        self, session: str, chunks: Sequence[PinnedChunk], dst_pages: np.ndarray, dst_slots: np.ndarray, timeout: float
    ) -> tuple[list, bool]:
        peer = self._peers.get(session)
        if peer is None:
            raise TransferError(f"no NIXL session {session!r}: the requester must say hello first")
        deadline = time.monotonic() + timeout
        if peer.slots is not None and len(dst_slots) >= len(chunks):
            if int(dst_slots.max()) >= peer.num_slots:
                raise TransferError(
                    f"destination slots {dst_slots.tolist()[:8]}... do not fit the requester's "
                    f"{peer.num_slots} GPU receive slots"
                )
            try:
                await self._send_staged(peer, chunks, dst_slots, deadline)
                return [], True
            except TransferError as e:
                if any(c.data.is_cuda for c in chunks):  # VRAM chunks reach no requester's pool pages
                    raise
                logger.warning(
                    "staged write of %d chunk(s) to %s failed (%s); writing its pool pages instead",
                    len(chunks),
                    peer.agent_name,
                    e,
                )
        if any(c.data.is_cuda for c in chunks):
            raise TransferError("GPU tier chunks are sent to staged sessions only")
        if len(dst_pages) < len(chunks) or (len(dst_pages) and int(dst_pages.max()) >= peer.num_pages):
            raise TransferError(
                f"destination pages {dst_pages.tolist()[:8]}... do not fit the requester's {peer.num_pages}-page pool"
            )
        src = [(c.data.data_ptr() - self.base) // self.pool.page_bytes for c in chunks]
        await self._write(
            peer, self._local_pages, src, peer.pages, [int(p) for p in dst_pages[: len(chunks)]], deadline
        )
        return [], False

    async def _send_staged(
        self, peer: _RemotePool, chunks: Sequence[PinnedChunk], dst_slots: np.ndarray, deadline: float
    ) -> None:
        """Into the requester's receive slots or GPU tier pages: chunks our GPU tier holds in one
        WRITE from there, the rest from pool pages through our send slots, as many at a time as
        send slots are free."""
        staging = self._staged  # the requester sent receive slots: we are staged
        in_tier = [(self._tier_index(c), int(dst_slots[i])) for i, c in enumerate(chunks)]
        direct = [(src, dst) for src, dst in in_tier if src is not None]
        if direct:
            await self._write(
                peer, self._local_slots, [src for src, _ in direct], peer.slots, [dst for _, dst in direct], deadline
            )
        on_host = [i for i, (src, _) in enumerate(in_tier) if src is None]
        if not on_host:
            return
        mine = await staging.sending.take(len(on_host), deadline - time.monotonic())
        try:
            for start in range(0, len(on_host), len(mine)):
                group = on_host[start : start + len(mine)]
                used = mine[: len(group)]
                await staging.to_slots([chunks[i].data for i in group], used)
                await self._write(peer, self._local_slots, used, peer.slots, [in_tier[i][1] for i in group], deadline)
        finally:
            staging.sending.give(mine)

    async def _write(self, peer: _RemotePool, local, src: list[int], remote, dst: list[int], deadline: float) -> None:
        """One NIXL WRITE of descriptors ``src`` of ``local`` into ``dst`` of ``remote``, waited for."""
        handle = await self._call(self.agent.make_prepped_xfer, "WRITE", local, src, remote, dst)
        try:
            state = await self._call(self.agent.transfer, handle)
            pause = _POLL_FIRST_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL write of {len(src)} chunk(s) to {peer.agent_name} not done in time")
                await asyncio.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)
                state = await self._call(self.agent.check_xfer_state, handle)
            if state != "DONE":
                raise TransferError(f"NIXL write to {peer.agent_name} failed ({state})")
        finally:
            await self._call(self._release, handle)

    @staticmethod
    def _release(handle) -> None:
        try:
            handle.release()
        except Exception as e:  # a transfer that could not be cancelled; NIXL logs it too
            logger.warning("releasing a NIXL transfer handle failed: %s", e)

    def close(self) -> None:
        def shutdown():
            for peer in self._peers.values():
                self._forget(peer)
            self._peers.clear()
            try:
                self.agent.release_dlist_handle(self._local_pages)
                self.agent.deregister_memory(self._registered)
                if self._local_slots is not None:
                    self.agent.release_dlist_handle(self._local_slots)
                    self.agent.deregister_memory(self._staged_registration)
                if self._gpu_tier_registration is not None:
                    self.agent.deregister_memory(self._gpu_tier_registration)
            except Exception as e:
                logger.debug("NIXL shutdown: %s", e)

        self._thread.submit(shutdown).result(timeout=10)
        self._thread.shutdown(wait=False)
        if self.staging is not None:
            self.staging.close()
