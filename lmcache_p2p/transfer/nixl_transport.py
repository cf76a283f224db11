"""The nixl channel: the holder WRITEs its pool pages into the requester's pool pages.

Each process registers its whole CPU page pool with one NIXL agent (UCX backend) once, and
prepares a descriptor list with one entry per page, so a transfer is "pages [3, 9] of mine to
pages [0, 1] of yours" by index: no per-transfer registration. A requester sends its agent
metadata and pool geometry once per holder (the hello on p2p_init); the holder adds it as a
remote agent and prepares the requester's page list.

Every NIXL call runs on one dedicated thread: the agent is used from one thread only (no reliance
on NIXL's thread-sync modes), a large transfer that completes inside ``transfer()`` never blocks
the worker's event loop, and completion is polled with a growing sleep rather than a busy spin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lmcache_p2p.protocol import ChannelHello
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.storage.memory import PagePool
from lmcache_p2p.transfer.base import TransferError, Transport

logger = logging.getLogger(__name__)

_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.005


@dataclass
class _RemotePool:
    agent_name: str
    instance: tuple[str, int]
    pages: object  # NIXL prepared descriptor list handle
    num_pages: int


def _page_descs(base: int, num_pages: int, page_bytes: int) -> np.ndarray:
    descs = np.zeros((num_pages, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_pages, dtype=np.uint64) * np.uint64(page_bytes)
    descs[:, 1] = page_bytes
    return descs


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

    def __init__(self, pool: PagePool, session: str, progress_delay_us: int = 200):
        super().__init__(pool, session)
        if pool.num_pages == 0:
            raise TransferError("the CPU page pool is empty: nothing to register with NIXL")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise TransferError(f"NIXL is not importable here ({e}); install nixl or use transfer_channel: tcp") from None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="lmcache-nixl")
        try:
            with _progress_thread_delay(progress_delay_us):
                self.agent = nixl_agent(session, nixl_agent_config(backends=["UCX"]))
        except Exception as e:
            raise TransferError(f"NIXL agent could not start: {e}") from None
        if "UCX" not in self.agent.backends:
            raise TransferError("NIXL has no UCX backend here; use transfer_channel: tcp")
        self.base = pool.buffer.data_ptr()
        size = pool.num_pages * pool.page_bytes
        t0 = time.perf_counter()
        self._registered = self.agent.register_memory([(self.base, size, 0, "")], "DRAM")
        self._local_pages = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _page_descs(self.base, pool.num_pages, pool.page_bytes), "DRAM")
        self._metadata = self.agent.get_agent_metadata()
        self._peers: dict[str, _RemotePool] = {}
        logger.info("NIXL agent %s: registered %d pages x %.2f MiB (%.2f GiB) in %.1f ms", session, pool.num_pages,
                    pool.page_bytes / 2**20, size / 2**30, (time.perf_counter() - t0) * 1e3)

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- requester side --------------------------------------------------------------------------

    def hello(self, instance_id: str, rank: int, fingerprint: int) -> ChannelHello:
        hello = super().hello(instance_id, rank, fingerprint)
        hello.agent_metadata = self._metadata
        hello.pool_base = self.base
        return hello

    def prepare(self, pages: Sequence[int]) -> None:
        self.pool.make_resident(pages)

    # -- holder side -----------------------------------------------------------------------------

    async def accept(self, hello: ChannelHello) -> None:
        if hello.session in self._peers:
            return
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
        pages = await self._call(self.agent.prep_xfer_dlist, name,
                                 _page_descs(hello.pool_base, hello.num_pages, hello.page_bytes), "DRAM")
        self._peers[hello.session] = _RemotePool(name, instance, pages, hello.num_pages)
        logger.info("NIXL session from %s rank %d (%s, %d pages)", hello.instance_id, hello.rank, name, hello.num_pages)

    def _forget(self, peer: _RemotePool) -> None:
        try:
            self.agent.release_dlist_handle(peer.pages)
            self.agent.remove_remote_agent(peer.agent_name)
        except Exception as e:
            logger.debug("forgetting NIXL peer %s: %s", peer.agent_name, e)

    def addressable(self, chunk: PinnedChunk) -> bool:
        offset = chunk.data.data_ptr() - self.base
        return 0 <= offset < self.pool.num_pages * self.pool.page_bytes and offset % self.pool.page_bytes == 0

    async def send(self, session: str, chunks: Sequence[PinnedChunk], dst_pages: np.ndarray,
                   timeout: float) -> list:
        peer = self._peers.get(session)
        if peer is None:
            raise TransferError(f"no NIXL session {session!r}: the requester must say hello first")
        if len(dst_pages) < len(chunks) or (len(dst_pages) and int(dst_pages.max()) >= peer.num_pages):
            raise TransferError(f"destination pages {dst_pages.tolist()[:8]}... do not fit the requester's "
                                f"{peer.num_pages}-page pool")
        src = [(c.data.data_ptr() - self.base) // self.pool.page_bytes for c in chunks]
        dst = [int(p) for p in dst_pages[:len(chunks)]]
        deadline = time.monotonic() + timeout
        handle = await self._call(self.agent.make_prepped_xfer, "WRITE", self._local_pages, src, peer.pages, dst)
        try:
            state = await self._call(self.agent.transfer, handle)
            pause = _POLL_FIRST_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL write of {len(chunks)} chunk(s) to {peer.agent_name} "
                                        f"not done within {timeout:.1f}s")
                await asyncio.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)
                state = await self._call(self.agent.check_xfer_state, handle)
            if state != "DONE":
                raise TransferError(f"NIXL write to {peer.agent_name} failed ({state})")
        finally:
            await self._call(self._release, handle)
        return []

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
            except Exception as e:
                logger.debug("NIXL shutdown: %s", e)
        self._thread.submit(shutdown).result(timeout=10)
        self._thread.shutdown(wait=False)
