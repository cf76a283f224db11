"""The wire protocol between workers and the controller (and peers' command sockets).

Every message is a msgspec Struct in a tagged union, encoded as msgpack. Both sides import this
module and nothing else to agree on the wire; it imports neither torch nor vLLM.

Sockets (DESIGN.md §5):
    pull  (controller PULL  <- worker PUSH)     KeyEvents, Deregister, CommandDone
    reply (controller ROUTER <-> worker DEALER) Register, ResyncBatch, P2PLookup -> replies
    heartbeat (ROUTER <-> DEALER)               Heartbeat -> HeartbeatReply (may ask for a resync,
                                                or carry a new warm set of peers)
    worker command port (controller DEALER -> worker ROUTER)   Move/Copy/Clear/Pin/Health/Status
Request/reply frames on ROUTER/DEALER pairs are ``[request_id, payload]`` so answers can be
matched to questions (``lmcache_p2p.rpc`` frames them); the PULL socket carries bare payloads.

Chunk hashes travel packed as little-endian uint64 bytes (``pack_hashes``): decoding a batch of a
million keys is then a zero-copy ``np.frombuffer`` rather than a million Python ints.

Commands expire. The controller waits ``--command-timeout`` for an answer and then reports the
command as failed (504); a worker that was stopped or stalled may still find it in its socket
later. So every command carries ``deadline_unix`` (the controller's wall clock when it stops
waiting), and a worker that reads one later than ``deadline_unix - COMMAND_CLOCK_MARGIN_S`` by
its own clock refuses it unrun ("expired"). The margin covers the two hosts' clocks disagreeing
and the answer's trip back: controller and worker clocks must agree within
``COMMAND_CLOCK_MARGIN_S`` (0.5 s; NTP or chrony keeps hosts within milliseconds). Clocks further
apart than that break the rule both ways: a worker behind the controller may run a command the
controller already gave up on; one ahead refuses fresh commands as expired (its log says by how
much, which is the skew to fix).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

from lmcache_p2p.keys import LayoutFingerprint

PROTOCOL_VERSION = 1

HASH_DTYPE = np.dtype("<u8")


PAGE_DTYPE = np.dtype("<u4")


def _pack(values: Sequence[int] | np.ndarray, dtype: np.dtype) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def _unpack(data: bytes, dtype: np.dtype, what: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise ValueError(f"packed {what} must be a multiple of {dtype.itemsize} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=dtype)


def pack_hashes(hashes: Sequence[int] | np.ndarray) -> bytes:
    return _pack(hashes, HASH_DTYPE)


def unpack_hashes(data: bytes) -> np.ndarray:
    return _unpack(data, HASH_DTYPE, "hashes")


def pack_pages(pages: Sequence[int]) -> bytes:
    """Pool page indices (ChunkPull.pages) as little-endian uint32."""
    return _pack(pages, PAGE_DTYPE)


def unpack_pages(data: bytes) -> np.ndarray:
    return _unpack(data, PAGE_DTYPE, "pages")


class _Msg(msgspec.Struct, kw_only=True, tag_field="type"):
    pass


# -- worker -> controller ----------------------------------------------------------------------


class Register(_Msg, tag="register"):
    """First message of a worker (one per engine rank), and again after a controller restart."""

    version: int
    instance_id: str
    rank: int
    host: str
    worker_port: int  # the worker's command socket (ROUTER) the controller connects to
    layout: LayoutFingerprint
    chunk_size: int
    locations: list[str]  # e.g. ["LocalCPUBackend", "LocalDiskBackend"]
    p2p_init_port: int | None = None
    p2p_lookup_port: int | None = None
    transfer_channel: str | None = None  # as configured
    # The channel this rank runs: "tcp" where the configured one could not start here (NIXL not
    # importable...), with the reason in channel_error. None from senders that do not say.
    effective_channel: str | None = None
    channel_error: str | None = None
    session: str = ""  # unique per process: a peer seeing a new one knows this rank restarted
    # How many peers of its layout it wants connected ahead of its first pull (its warm set,
    # config p2p_max_warm_peers); None or 0: no list, it connects on demand.
    max_warm_peers: int | None = None
    # The OpenAI-compatible URL this instance's engine serves on (e.g. "http://10.0.0.7:8000"), so
    # a router that asked the controller's POST /route can forward the request there. Every rank
    # of an instance may send it; None from senders that do not say (routing still ranks them).
    serve_url: str | None = None
    # The LoRA adapters its engine has served: name -> lora_id (keys.KeyIdentity: a digest of
    # the adapter's path and weights), so the controller can key a request that names an adapter
    # as this engine does. None from senders that do not say (older ones, or none served).
    adapters: dict[str, str] | None = None


class MeshPeer(msgspec.Struct, kw_only=True):
    """A live rank of the asker's layout that it should keep a channel open to (its warm set)."""

    instance_id: str
    rank: int
    host: str
    p2p_init_port: int
    p2p_lookup_port: int
    channel: str | None = None  # its effective transfer channel
    session: str = ""  # its process; another session at the same address is a restart


class RegisterReply(_Msg, tag="register_reply"):
    ok: bool
    error: str | None = None
    controller_epoch: str = ""
    heartbeat_interval: float = 5.0
    heartbeat_port: int = 0  # the heartbeat socket, on the host of controller_reply_url
    # Locations whose full key set the controller wants now (ResyncBatch); every location on a
    # (re-)register, so a restarted controller or a restarted worker converges.
    resync: list[str] = []
    # The worker's warm set (when it asked for one) and its version, to echo in heartbeats.
    peers: list[MeshPeer] | None = None
    peers_version: int = 0


class Deregister(_Msg, tag="deregister"):
    instance_id: str
    rank: int


class KeyEvents(_Msg, tag="key_events"):
    """A batch of admits and evicts at one location. ``seq`` counts batches per (worker, location)
    from 1; a gap tells the controller it missed a batch and must ask for a resync."""

    instance_id: str
    rank: int
    location: str
    seq: int
    admitted: bytes = b""  # pack_hashes
    evicted: bytes = b""


class ResyncBatch(_Msg, tag="resync"):
    """One batch of a location's full key set, taken when the location's seq was ``snapshot_seq``.
    Batches are numbered from 0; the one with ``last`` set replaces what the controller had."""

    instance_id: str
    rank: int
    location: str
    snapshot_seq: int
    batch: int
    last: bool
    keys: bytes = b""


class Traffic(msgspec.Struct, kw_only=True):
    """A rank's totals since it started, sent with every heartbeat. The controller turns the
    differences between heartbeats into the fleet's rates (lookups/s, hit ratio, P2P bytes/s);
    a new ``started_at`` means the rank restarted and its totals began again."""

    started_at: float = 0.0  # wall clock when these totals began (the worker's start)
    lookups: int = 0  # prefix lookups the engine asked this rank
    lookup_tokens: int = 0  # prompt tokens those lookups covered
    hit_tokens: int = 0  # of those, found: in this rank's own tiers or pulled from peers
    peer_hit_tokens: int = 0  # pulled from peers for lookups (part of hit_tokens)
    pulls: int = 0  # peer pulls that brought chunks
    pull_failures: int = 0
    pulled_bytes: int = 0
    served_bytes: int = 0  # sent to peers that pulled from this rank
    # The pull policy's skips (p2p_pull_policy auto): prefix pulls not made because recomputing
    # was estimated faster, and the tokens peers offered that were recomputed instead.
    pulls_skipped: int = 0
    skipped_tokens: int = 0


class EngineLoad(msgspec.Struct, kw_only=True):
    """How busy the engine behind a rank is, as of this heartbeat: what the controller's POST
    /route weighs besides the cache (lmcache_p2p/controller/routing.py). Gauges, not totals: each
    heartbeat replaces the last. Every rank of an engine may send the engine's own numbers."""

    running: int  # requests the scheduler is running now (prefill or decode)
    waiting: int  # requests queued behind them
    kv_usage: float  # fraction of the engine's KV cache blocks in use, 0..1
    # False: running/waiting/kv_usage are not known (the rank reads them from its engine's
    # serve_url /metrics: rank 0 only, and only with serve_url set) and the zeros mean nothing.
    queue_reported: bool = True
    # The engine's measured prefill rate, tokens/s (the pull policy's PrefillRate); 0: not
    # measured yet, and the controller uses --route-prefill-tokens-per-s.
    prefill_tokens_per_s: float = 0.0
    # How many prefill steps that rate was measured over: the controller trusts a rate measured
    # over few (a cold engine's first step can be several times slower than its next) only when
    # no candidate's is measured over more (--route-prefill-min-steps).
    prefill_steps: int = 0
    # This rank's measured peer-pull bandwidth, bytes/s, and fixed cost per pull, ms (the pull
    # policy's LinkEstimate over its links, e.g. their median); 0: not measured yet, and the
    # controller uses --route-pull-gbps / --route-pull-fixed-ms. Traffic's totals cannot give
    # these: pulled_bytes grows only while pulling, and the totals do not say for how long.
    pull_bytes_per_s: float = 0.0
    pull_fixed_ms: float = 0.0


class Heartbeat(_Msg, tag="heartbeat"):
    instance_id: str
    rank: int
    controller_epoch: str  # the epoch the worker registered with ("" if never)
    traffic: Traffic | None = None  # None from senders that keep no totals
    peers_version: int = 0  # of the last warm set received: the reply carries a new one only on change
    # The last KeyEvents batch number sent per location, as of the heartbeat before this one
    # (batches sent since may still be on their way on the pull socket). A controller that has
    # not seen that batch lost the stream's tail, which no later batch would reveal: it asks
    # for a re-sync. None from senders that do not say.
    event_seqs: dict[str, int] | None = None
    load: EngineLoad | None = None  # None from senders that do not report their engine's load
    # The engine's adapters (name -> lora_id, as Register.adapters), whole, when they changed
    # since this link's last answered heartbeat; None: unchanged (or never reported).
    adapters: dict[str, str] | None = None


class HeartbeatReply(_Msg, tag="heartbeat_reply"):
    # "ok"; or "unknown": the controller does not know this worker (it restarted, or reaped the
    # worker): register again.
    status: Literal["ok", "unknown"]
    controller_epoch: str
    resync: list[str] = []
    peers: list[MeshPeer] | None = None  # a new warm set; None: unchanged since peers_version
    peers_version: int = 0


class P2PLookup(_Msg, tag="p2p_lookup"):
    """Which peers hold a prefix of these chunk hashes (in prompt order)?"""

    instance_id: str
    rank: int
    hashes: bytes


class PeerHolder(msgspec.Struct, kw_only=True):
    instance_id: str
    rank: int
    location: str
    matched_chunks: int  # leading chunks of the asked hashes this holder has
    host: str
    p2p_init_port: int | None
    p2p_lookup_port: int | None
    transfer_channel: str | None


class P2PLookupReply(_Msg, tag="p2p_lookup_reply"):
    holders: list[PeerHolder]  # longest prefix first; never the asking instance
    # Why the first chunk no holder offers is not offered (miss_reasons: layout_mismatch,
    # partial_tp, or not_held when no live instance holds it), with the instance and numbers.
    miss_reason: str = ""
    miss_detail: str = ""


class CommandDone(_Msg, tag="command_done"):
    """A worker finished an asynchronous command (move/copy) it had accepted."""

    event_id: str
    instance_id: str
    rank: int
    ok: bool
    num_tokens: int = 0
    error: str | None = None


class Ack(_Msg, tag="ack"):
    ok: bool
    error: str | None = None


# -- controller -> worker (command socket) -------------------------------------------------------

# How far the controller's and a worker's wall clocks may disagree (plus an answer's trip back)
# without breaking "a command the controller reported as failed never runs" (module docstring).
COMMAND_CLOCK_MARGIN_S = 0.5


class _Command(_Msg, kw_only=True):
    """What every controller -> worker command carries."""

    event_id: str
    # The controller's wall clock (time.time()) when it stops waiting for the answer: it sets
    # now + its command timeout as it sends. 0: no deadline (a sender that does not set one).
    deadline_unix: float = 0.0


def seconds_past_deadline(command: _Command, now_unix: float, margin_s: float = COMMAND_CLOCK_MARGIN_S) -> float:
    """How late ``command`` is at ``now_unix`` (a worker's clock): > 0 means it expired and must not
    run. The margin is taken off the deadline, so clocks up to ``margin_s`` apart still never run
    a command after the controller gave up on it."""
    if command.deadline_unix <= 0:
        return float("-inf")
    return now_unix - (command.deadline_unix - margin_s)


class PeerAddress(msgspec.Struct, kw_only=True):
    instance_id: str
    rank: int
    location: str
    host: str
    p2p_init_port: int | None
    p2p_lookup_port: int | None


class MoveCommand(_Command, tag="move"):
    """Send these chunks from ``location`` to ``destination``; evict them here unless ``copy``.
    Accepted at once (CommandReply.pending), finished with a CommandDone."""

    location: str
    hashes: bytes
    destination: PeerAddress
    copy: bool = False


class ClearCommand(_Command, tag="clear"):
    location: str


class PinCommand(_Command, tag="pin"):
    location: str
    hashes: bytes
    unpin: bool = False


class HealthCommand(_Command, tag="health"):
    pass


class StatusCommand(_Command, tag="status"):
    pass


class CommandReply(_Msg, tag="command_reply"):
    event_id: str
    ok: bool
    pending: bool = False  # accepted; a CommandDone follows
    num_tokens: int = 0
    error: str | None = None
    detail: dict = {}


# -- peer <-> peer (p2p_init and p2p_lookup sockets) ---------------------------------------------
#
# The peer that wants chunks (the requester) opens a session on the holder's p2p_init port, then
# asks for chunks on its p2p_lookup port. Over NIXL the holder WRITEs the payloads straight into
# pages the requester reserved (named by page index in its registered pool); over TCP they ride
# the reply as extra frames, one per chunk. Either way the reply carries each chunk's checksum.


class ChannelHello(_Msg, tag="channel_hello"):
    instance_id: str
    rank: int
    fingerprint: int  # the requester's layout digest; the holder refuses another layout
    channel: str  # "nixl" | "tcp"
    session: str  # unique per requester process (its NIXL agent name under "nixl")
    agent_metadata: bytes = b""
    pool_base: int = 0  # address of the requester's registered page pool
    page_bytes: int = 0
    num_pages: int = 0
    # GPU staging (nixl, same host): the requester's receive slots, page_bytes each, in VRAM.
    host_id: str = ""  # hostname/boot id: cuda_ipc reaches only processes of the same host
    staging_base: int = 0
    staging_slots: int = 0
    staging_device: int = 0
    # Its GPU tier's pages (local_gpu), on the same device: a staged pull's slots number the
    # receive slots first, then these pages (slot staging_slots + i is GPU tier page i).
    gpu_tier_base: int = 0
    gpu_tier_pages: int = 0


class ChannelHelloReply(_Msg, tag="channel_hello_reply"):
    ok: bool
    error: str | None = None
    channels: list[str] = []  # what this holder can serve
    staged: bool = False  # the holder will write through GPU staging (pulls carry slots)
    # tcp: the holder's data port (on its p2p host) and the token each data connection opens
    # with; 0 when it has none, and payloads ride the replies as frames.
    data_port: int = 0
    data_token: bytes = b""


class ChunkPull(_Msg, tag="chunk_pull"):
    """Send me these chunks (in order). ``pages`` (uint32 LE, one per hash) are the requester's
    pool pages to WRITE into under "nixl"; empty under "tcp". ``slots`` (same form), when the
    session is staged, are its GPU receive slots or GPU tier pages (numbered as ChannelHello says):
    the holder writes there instead if it can."""

    session: str
    fingerprint: int
    hashes: bytes
    pages: bytes = b""
    slots: bytes = b""
    timeout_s: float = 10.0  # how long the requester waits; the holder gives up sooner
    transfer: int = 0  # tcp: tag the payloads with this and write them to the data connections
    # Non-zero: the slots are GPU tier pages, checked on the device after landing; send device
    # checksums of this version (lmcache_p2p.device_checksum.VERSION) of the chunks you write.
    device_check: int = 0


class ChunkPullReply(_Msg, tag="chunk_pull_reply"):
    """``served`` leading chunks were sent (the first one the holder lacks ends the run);
    ``checksums`` has one uint64 per served chunk."""

    ok: bool
    served: int = 0
    checksums: bytes = b""
    error: str | None = None
    staged: bool = False  # the payloads are in the requester's slots, not its pages
    holder_ms: float = 0.0  # the holder's time on it: pins, checksums, copies, the write
    # Of holder_ms, the send: a NIXL write (from host memory: with the copies into send slots and
    # any wait for them), or handing tcp payloads to the data streams; ~0 for payloads that ride
    # the reply, which go after it (the requester's queue+wire then holds them).
    holder_write_ms: float = 0.0
    streamed: bool = False  # the payloads went over the data connections (ChunkPull.transfer)
    # With ChunkPull.device_check (a version the holder has), one uint64 per served chunk when
    # every one was sent from the holder's GPU tier, checked there (else empty, and the
    # requester checks them on the host, later).
    device_checksums: bytes = b""


class FetchChunks(_Msg, tag="fetch_chunks"):
    """Move/copy, sent by the source's worker to the destination's p2p_lookup port: pull these
    chunks from me into your ``location``."""

    event_id: str
    source: PeerAddress
    location: str
    hashes: bytes
    fingerprint: int


class FetchReply(_Msg, tag="fetch_reply"):
    ok: bool
    held: bytes = b""  # hashes the destination holds now (pulled, or held already)
    error: str | None = None


WorkerMessage = Register | Deregister | KeyEvents | ResyncBatch | Heartbeat | P2PLookup | CommandDone
ControllerReply = RegisterReply | HeartbeatReply | P2PLookupReply | Ack
Command = MoveCommand | ClearCommand | PinCommand | HealthCommand | StatusCommand

encode = msgspec.msgpack.Encoder().encode
worker_message_decoder = msgspec.msgpack.Decoder(WorkerMessage)
controller_reply_decoder = msgspec.msgpack.Decoder(ControllerReply)
command_decoder = msgspec.msgpack.Decoder(Command)
command_reply_decoder = msgspec.msgpack.Decoder(CommandReply)
PeerReply = ChannelHelloReply | ChunkPullReply | FetchReply | Ack
peer_reply_decoder = msgspec.msgpack.Decoder(PeerReply)

DecodeError = (msgspec.DecodeError, msgspec.ValidationError)
