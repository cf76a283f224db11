"""What every transfer channel provides, on both sides of a pull.

A channel either writes into the requester's pages itself (NIXL), returns the payloads as reply
frames (tcp without its data port), or streams them over connections of its own (tcp): the
optional hooks below (``listen``/``offer`` on the holder, ``connect``/``begin`` on the requester,
``send_streamed``) are no-ops for channels without such connections.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lmcache_p2p.protocol import ChannelHello, ChannelHelloReply
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.storage.memory import PagePool


class TransferError(Exception):
    """A transfer could not start or did not finish; the chunks involved are a miss."""


# What a hello may declare. A holder sizes per-session state by these fields (NIXL: a descriptor
# per page and per slot, prepared against the requester's agent), so a hello is refused before
# anything is built from it when they go beyond any real pool: 2^24 pages cost a holder +885 MB.
# Real pools: a few GiB to a few hundred GiB of host memory in pages of 0.1-100 MiB, so tens to
# hundreds of thousands of pages; staging is 32 pages by default (nixl_buffer_size).
MAX_HELLO_PAGES = 2**22  # 4M pages: a 1 TiB pool of 256 KiB pages
MAX_HELLO_POOL_BYTES = 2**40  # num_pages x page_bytes: 1 TiB of host memory
MAX_HELLO_STAGING_SLOTS = 2**16
MAX_HELLO_STAGING_BYTES = 2**40  # staging_slots x page_bytes, in VRAM
MAX_HELLO_PAGE_BYTES = 2**32  # 4 GiB: a chunk of 256 tokens of a model with 16 MiB of KV a token
MAX_AGENT_METADATA_BYTES = 4 * 2**20  # NIXL over UCX: 0.5 KiB with one registered pool here
_MAX_ADDRESS = 2**64


def check_hello_bounds(hello: ChannelHello) -> None:
    """Refuse (TransferError naming the field and its value) a hello whose geometry no real
    requester has, before a holder builds anything from it."""

    def refuse(field: str, value: int, expected: str) -> TransferError:
        return TransferError(f"hello refused: {field}={value}, expected {expected}")

    for field, value, limit in (
        ("num_pages", hello.num_pages, MAX_HELLO_PAGES),
        ("page_bytes", hello.page_bytes, MAX_HELLO_PAGE_BYTES),
        ("staging_slots", hello.staging_slots, MAX_HELLO_STAGING_SLOTS),
        ("gpu_tier_pages", hello.gpu_tier_pages, MAX_HELLO_PAGES),
    ):
        if not 0 <= value <= limit:
            raise refuse(field, value, f"0 to {limit}")
    if len(hello.agent_metadata) > MAX_AGENT_METADATA_BYTES:
        raise refuse("agent_metadata", len(hello.agent_metadata), f"at most {MAX_AGENT_METADATA_BYTES} bytes")
    pool_bytes = hello.num_pages * hello.page_bytes
    if pool_bytes > MAX_HELLO_POOL_BYTES:
        raise refuse(
            "num_pages",
            hello.num_pages,
            f"a pool of at most {MAX_HELLO_POOL_BYTES >> 30} GiB ({hello.page_bytes}-byte pages)",
        )
    for field, count, what in (
        ("staging_slots", hello.staging_slots, "staging"),
        ("gpu_tier_pages", hello.gpu_tier_pages, "GPU tier"),
    ):  # both in VRAM, both named by index in a staged pull's slots
        if count * hello.page_bytes > MAX_HELLO_STAGING_BYTES:
            raise refuse(
                field, count, f"at most {MAX_HELLO_STAGING_BYTES >> 30} GiB of {what} ({hello.page_bytes}-byte pages)"
            )
    staging_bytes = hello.staging_slots * hello.page_bytes
    gpu_tier_bytes = hello.gpu_tier_pages * hello.page_bytes
    for field, base, size in (
        ("pool_base", hello.pool_base, pool_bytes),
        ("staging_base", hello.staging_base, staging_bytes),
        ("gpu_tier_base", hello.gpu_tier_base, gpu_tier_bytes),
    ):
        if not 0 <= base <= _MAX_ADDRESS - size:
            raise refuse(field, base, "an address range inside 64 bits")
    if hello.staging_device < 0:
        raise refuse("staging_device", hello.staging_device, "a device index >= 0")


class Landing:
    """One request's payloads arriving over a channel's own data connections, into the pages it
    was begun with. Until :meth:`close` says it is idle, something may still write into them."""

    id: int  # the number the holder tags this request's payload with (ChunkPull.transfer)

    async def landed(self, count: int, timeout: float) -> None:
        """Wait until the first ``count`` pages are complete; TransferError if they are not in
        time or the connection they come on broke."""
        raise NotImplementedError

    def close(self, on_idle: Callable[[], None]) -> bool:
        """Stop landing: whatever still arrives for it is thrown away. Returns True when nothing
        writes into its pages any more; else ``on_idle`` runs (on the caller's loop) once that is
        so, and the pages must stay out of use until then."""
        raise NotImplementedError


class Transport:
    name: str

    def __init__(self, pool: PagePool, session: str):
        self.pool = pool
        self.session = session  # unique per process: names this requester to holders

    # -- requester side --------------------------------------------------------------------------

    def hello(self, instance_id: str, rank: int, fingerprint: int) -> ChannelHello:
        return ChannelHello(
            instance_id=instance_id,
            rank=rank,
            fingerprint=fingerprint,
            channel=self.name,
            session=self.session,
            page_bytes=self.pool.page_bytes,
            num_pages=self.pool.num_pages,
        )

    async def connect(self, peer: tuple[str, int], reply: ChannelHelloReply) -> None:
        """After a holder (``peer``: its host and p2p_lookup port) accepted our hello: open what
        its reply offers beside the request socket. Never raises: without it, pulls still work."""

    def max_batch(self, into_gpu_tier: bool = False) -> int | None:
        """The most chunks one request may carry on this channel (None: no limit of its own);
        ``into_gpu_tier``: for a pull that may land in our GPU tier (the engine's prefix pulls)."""
        return None

    async def prepare(self, pages: Sequence[int], staged: bool, timeout: float, gpu_tier: bool = False) -> list[int]:
        """Get ``pages`` ready to be written by the holder (before the request goes out); on a
        staged session, also the receive slots the holder may write into instead (empty when
        none are free, and the holder then writes the pages). With ``gpu_tier`` (a pull for the
        engine), GPU tier pages instead of receive slots where there is a GPU tier."""
        return []

    def begin(self, peer: tuple[str, int], pages: Sequence[int]) -> Landing | None:
        """Expect a request's payloads from ``peer`` over this channel's own connections, into
        ``pages``; None when there are none (they ride the reply, or the holder writes them)."""
        return None

    async def land(self, frames: list, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Place what arrived into ``pages``: from the reply's frames, or from the receive
        ``slots`` the holder wrote (nothing to do when it wrote the pages directly)."""

    def release(self, slots: Sequence[int]) -> None:
        """Give back receive slots (and GPU tier pages) taken by prepare, once nothing can write
        into them."""

    def gpu_landing(self, slots: Sequence[int]) -> list[int]:
        """The GPU tier pages ``slots`` (from :meth:`prepare`) are, when the holder writes a pull
        straight into the GPU tier; empty when they are receive slots, or there are none."""
        return []

    # -- holder side -----------------------------------------------------------------------------

    def listen(self, host: str) -> None:
        """Open this channel's own data port on ``host`` (the instance's p2p host), if it has
        one. Raises OSError when it cannot."""

    async def accept(self, hello: ChannelHello) -> bool:
        """Open a session for a requester; returns whether its pulls go through GPU staging.
        Raises TransferError to refuse it."""
        return False

    def offer(self, session: str) -> tuple[int, bytes]:
        """What to put in an accepted session's hello reply (``data_port``, ``data_token``):
        where and with what the requester opens this channel's data connections; (0, b"") for none."""
        return 0, b""

    def addressable(self, chunk: PinnedChunk) -> bool:
        """Whether this channel can send ``chunk`` (NIXL only reaches the registered pool)."""
        return True

    def reads_gpu_tier(self, session: str) -> bool:
        """Whether a send to ``session`` can read chunks from the GPU tier (VRAM pages): holders
        then pin the GPU tier's copy of a chunk first."""
        return False

    async def send_streamed(
        self, session: str, chunks: Sequence[PinnedChunk], transfer: int, timeout: float
    ) -> float | None:
        """Write ``chunks`` to the session's data connections, tagged ``transfer``, before this
        returns. Returns the seconds it waited behind the session's earlier requests for them,
        or None when the session has none (the caller then uses :meth:`send`)."""
        return None

    async def send(
        self, session: str, chunks: Sequence[PinnedChunk], dst_pages: np.ndarray, dst_slots: np.ndarray, timeout: float
    ) -> tuple[list, bool]:
        """Deliver ``chunks`` to the requester: written into its ``dst_pages`` (or, returning
        staged=True, its receive ``dst_slots``) before this returns, or returned as frames to
        append to the reply. Returns (frames, staged). The caller keeps the chunks pinned until
        the reply is sent."""
        raise NotImplementedError

    def close(self) -> None:
        pass
