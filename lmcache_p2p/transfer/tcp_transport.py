"""The tcp channel: payloads as reply frames on the holder's p2p_lookup socket."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.transfer.base import TransferError, Transport


class TcpTransport(Transport):
    name = "tcp"

    async def land(self, frames: list, pages: Sequence[int], slots: Sequence[int]) -> None:
        if len(frames) < len(pages):
            raise TransferError(f"reply carried {len(frames)} payload frame(s) for {len(pages)} chunk(s)")
        # Too few frames is an error (above); frames past the pages asked for are ignored.
        for frame, page in zip(frames, pages, strict=False):
            data = np.frombuffer(frame.buffer, dtype=np.uint8)
            if data.size != self.pool.page_bytes:
                raise TransferError(f"payload frame of {data.size} bytes; pages are {self.pool.page_bytes}")
            self.pool.page(page).numpy()[:] = data

    async def send(
        self, session: str, chunks: Sequence[PinnedChunk], dst_pages: np.ndarray, dst_slots: np.ndarray, timeout: float
    ) -> tuple[list, bool]:
        # Zero-copy: ZMQ reads straight from the pinned pages (the caller holds the pins until
        # the send is tracked as done).
        return [chunk.data.numpy() for chunk in chunks], False
