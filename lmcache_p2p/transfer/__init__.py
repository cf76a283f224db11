"""Transfer channels: how chunk payloads travel from the peer that holds them to the one that
wants them (``transfer_channel`` in the config).

* ``nixl``: the holder WRITEs pool pages straight into the requester's pool pages over NIXL
  (UCX), one registration of each pool per process; no copy through sockets. Between processes
  of one host with CUDA, through GPU staging slots on both ends instead (gpu_staging;
  ``nixl_buffer_device``), because NIXL moves GPU memory over cuda_ipc ~200x faster.
* ``tcp``: for hosts where NIXL/UCX cannot run: the payloads go over plain TCP data streams the
  requester opens at hello, received straight into its reserved pool pages (tcp_transport); a
  holder without a data port sends them as ZMQ reply frames instead.

A holder serves every channel it has (tcp always), so a requester configured for nixl still gets
chunks from a tcp-only peer. A rank configured for nixl where NIXL cannot run serves and pulls over
tcp; the error it gets here names the fix (:data:`NIXL_FIX`), and the worker logs it as an ERROR.
"""

import logging

from lmcache_p2p.transfer.base import TransferError, Transport
from lmcache_p2p.transfer.tcp_transport import TcpTransport

__all__ = ["NIXL_FIX", "Transport", "TransferError", "TcpTransport", "make_transport", "nixl_import_error"]

logger = logging.getLogger(__name__)

# What an operator does about NIXL missing here: every error that says so ends with it.
NIXL_FIX = "pip install 'lmcache-p2p[nixl]' (or pip install nixl), or set transfer_channel: tcp"


def nixl_import_error() -> str | None:
    """Why NIXL cannot be imported in this process, or None when it can. Checked before anything
    is allocated for it (GPU staging), so a host without NIXL says so first and wastes nothing."""
    try:
        import nixl._api  # noqa: F401  (kept imported: the transport uses it next)
    except (ImportError, OSError) as e:  # OSError: the package is there, a library it loads is not
        return str(e) or type(e).__name__
    return None


def make_transport(
    channel: str,
    pool,
    session: str,
    nixl_progress_delay_us: int = 200,
    nixl_buffer_device: str = "cpu",
    nixl_buffer_size: int | None = None,
    engine_device=None,
    gpu_tier=None,
) -> Transport:
    """The transport for ``channel``; raises TransferError if it cannot run here. Under nixl,
    GPU staging goes on ``engine_device`` (or this process's CUDA device) unless
    ``nixl_buffer_device`` is "cpu"; with "auto", a staging buffer that cannot be had is logged
    and left out, with "cuda" it is an error. A ``gpu_tier`` (storage's GPU tier) is registered
    with NIXL beside the staging buffer: peers of this host then write into it and read from it."""
    if channel == "tcp":
        return TcpTransport(pool, session)
    if channel == "nixl":
        why = nixl_import_error()
        if why is not None:
            raise TransferError(f"NIXL cannot be imported here ({why}); fix: {NIXL_FIX}")
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
            return NixlTransport(
                pool,
                session,
                progress_delay_us=nixl_progress_delay_us,
                staging=staging,
                gpu_tier=gpu_tier,  # reached through staging only: unused without it
            )
        except BaseException:
            if staging is not None:
                staging.close()
            raise
    raise TransferError(f"unknown transfer_channel {channel!r}; expected 'nixl' or 'tcp'")
