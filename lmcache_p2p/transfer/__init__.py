"""Transfer channels: how chunk payloads travel from the peer that holds them to the one that
wants them (``transfer_channel`` in the config).

* ``nixl``: the holder WRITEs pool pages straight into the requester's pool pages over NIXL
  (UCX), one registration of each pool per process; no copy through sockets.
* ``tcp``: the payloads ride the reply on the ZMQ socket as one frame per chunk, for hosts where
  NIXL/UCX cannot run.

A holder serves every channel it has (tcp always), so a requester configured for nixl still gets
chunks from a tcp-only peer.
"""

from lmcache_p2p.transfer.base import Transport, TransferError
from lmcache_p2p.transfer.tcp_transport import TcpTransport

__all__ = ["Transport", "TransferError", "TcpTransport", "make_transport"]


def make_transport(channel: str, pool, session: str, nixl_progress_delay_us: int = 200) -> Transport:
    """The transport for ``channel``; raises TransferError if it cannot run here."""
    if channel == "tcp":
        return TcpTransport(pool, session)
    if channel == "nixl":
        from lmcache_p2p.transfer.nixl_transport import NixlTransport
        return NixlTransport(pool, session, progress_delay_us=nixl_progress_delay_us)
    raise TransferError(f"unknown transfer_channel {channel!r}; expected 'nixl' or 'tcp'")
