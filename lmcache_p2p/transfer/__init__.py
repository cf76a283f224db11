"""Transfer channels: how chunk payloads travel from the peer that holds them to the one that
wants them (``transfer_channel`` in the config).

* ``nixl``: the holder WRITEs pool pages straight into the requester's pool pages over NIXL
  (UCX), one registration of each pool per process; no copy through sockets. Between processes
  of one host with CUDA, through GPU staging slots on both ends instead (gpu_staging;
  ``nixl_buffer_device``), because NIXL moves GPU memory over cuda_ipc ~200x faster.
* ``tcp``: the payloads ride the reply on the ZMQ socket as one frame per chunk, for hosts where
  NIXL/UCX cannot run.

A holder serves every channel it has (tcp always), so a requester configured for nixl still gets
chunks from a tcp-only peer.
"""

import logging

from lmcache_p2p.transfer.base import TransferError, Transport
from lmcache_p2p.transfer.tcp_transport import TcpTransport

__all__ = ["Transport", "TransferError", "TcpTransport", "make_transport"]

logger = logging.getLogger(__name__)


def make_transport(
    channel: str,
    pool,
    session: str,
    nixl_progress_delay_us: int = 200,
    nixl_buffer_device: str = "cpu",
    nixl_buffer_size: int | None = None,
    engine_device=None,
) -> Transport:
    """The transport for ``channel``; raises TransferError if it cannot run here. Under nixl,
    GPU staging goes on ``engine_device`` (or this process's CUDA device) unless
    ``nixl_buffer_device`` is "cpu"; with "auto", a staging buffer that cannot be had is logged
    and left out, with "cuda" it is an error."""
    if channel == "tcp":
        return TcpTransport(pool, session)
    if channel == "nixl":
        from lmcache_p2p.transfer.gpu_staging import GpuStaging, staging_device
        from lmcache_p2p.transfer.nixl_transport import NixlTransport

        staging = None
        device = staging_device(nixl_buffer_device, engine_device)
        if device is not None:
            try:
                staging = GpuStaging(device, pool.page_bytes, nixl_buffer_size)
            except TransferError as e:
                if nixl_buffer_device == "cuda":
                    raise
                logger.warning("no GPU staging for NIXL pulls (%s); pulls go pool to pool", e)
        try:
            return NixlTransport(pool, session, progress_delay_us=nixl_progress_delay_us, staging=staging)
        except BaseException:
            if staging is not None:
                staging.close()
            raise
    raise TransferError(f"unknown transfer_channel {channel!r}; expected 'nixl' or 'tcp'")
