"""What every transfer channel provides, on both sides of a pull."""

from __future__ import annotations

from typing import Sequence

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
        return ChannelHello(instance_id=instance_id, rank=rank, fingerprint=fingerprint, channel=self.name,
                            session=self.session, page_bytes=self.pool.page_bytes, num_pages=self.pool.num_pages)

    def prepare(self, pages: Sequence[int]) -> None:
        """Get ``pages`` ready to be written by the holder (before the request goes out)."""

    def land(self, frames: list, pages: Sequence[int]) -> None:
        """Place what arrived with the reply into ``pages`` (nothing to do when the holder wrote
        into them directly)."""

    # -- holder side -----------------------------------------------------------------------------

    async def accept(self, hello: ChannelHello) -> None:
        """Open a session for a requester; raises TransferError to refuse it."""

    def addressable(self, chunk: PinnedChunk) -> bool:
        """Whether this channel can send ``chunk`` (NIXL only reaches the registered pool)."""
        return True

    async def send(self, session: str, chunks: Sequence[PinnedChunk], dst_pages: np.ndarray,
                   timeout: float) -> list:
        """Deliver ``chunks`` to the requester: either written into its ``dst_pages`` before this
        returns, or returned as frames to append to the reply. The caller keeps the chunks pinned
        until the reply is sent."""
        raise NotImplementedError

    def close(self) -> None:
        pass
