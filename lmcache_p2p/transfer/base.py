"""What every transfer channel provides, on both sides of a pull."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lmcache_p2p.protocol import ChannelHello
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.storage.memory import PagePool


class TransferError(Exception):
    """A transfer could not start or did not finish; the chunks involved are a miss."""


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

    @property
    def max_batch(self) -> int | None:
        """The most chunks one request may carry on this channel (None: no limit of its own)."""
        return None

    async def prepare(self, pages: Sequence[int], staged: bool, timeout: float) -> list[int]:
        """Get ``pages`` ready to be written by the holder (before the request goes out); on a
        staged session, also the receive slots the holder may write into instead (empty when
        none are free, and the holder then writes the pages)."""
        return []

    async def land(self, frames: list, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Place what arrived into ``pages``: from the reply's frames, or from the receive
        ``slots`` the holder wrote (nothing to do when it wrote the pages directly)."""

    def release(self, slots: Sequence[int]) -> None:
        """Give back receive slots taken by prepare (once nothing can write into them)."""

    # -- holder side -----------------------------------------------------------------------------

    async def accept(self, hello: ChannelHello) -> bool:
        """Open a session for a requester; returns whether its pulls go through GPU staging.
        Raises TransferError to refuse it."""
        return False

    def addressable(self, chunk: PinnedChunk) -> bool:
        """Whether this channel can send ``chunk`` (NIXL only reaches the registered pool)."""
        return True

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
