"""The lookup channel between vLLM's scheduler process and its worker processes.

vLLM asks "how many tokens of this prompt can you load" in the scheduler (EngineCore) process,
but the KV pages, the tiers and the peer client live in each TP rank's worker process. The
scheduler side sends a :class:`LookupRequest` to every rank over a local ZMQ ``ipc://`` socket
and takes the smallest answer (every rank must be able to load the prefix). A GPU rank also says
where the part of its hit held in host memory ends, and whether part of the hit is fetched (a
peer pull, the remote store), for ``async_kv_loads: auto`` to decide where the load runs.

A rank answers once, at once: from its local tiers and, when the prefix continues elsewhere, from
an offer of what comes next (a live peer's, through the controller's index and the pull policy;
else the remote store's, from one bounded ``exists`` round). The offered part is pulled by the
load, beside the engine's steps, so the scheduler never waits on bytes and there is nothing to
poll. A prompt travels as its chunk hashes, computed once by the scheduler.

With ``pull_before_grant`` the rank starts pulling the offer as it answers (``pull_now``) and,
unasked, sends :class:`PullEnded` once that pull ended: from the thread that ended the pull, on a
socket of its own (:class:`PullEndedSender`) to one the scheduler binds beside its lookups, so the
word waits for no other thread of the rank (on a CPU engine every thread of the rank shares one
interpreter with the step loop). The scheduler drains those words when vLLM asks about the
request again, then asks once more (``settle``) for what is held now. The word does not ride
vLLM's connector output, which reaches the scheduler a step or two after the worker wrote it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq

from lmcache_p2p.protocol import pack_hashes
from lmcache_p2p.vocab import HIT_SOURCES, SOURCE_REMOTE

logger = logging.getLogger(__name__)


class LookupRequest(msgspec.Struct, tag="lookup"):
    seq: int
    req_id: str
    fetch_missing: bool  # offer what the local tiers lack from peers and the remote store
    # The prompt's chunk hashes (protocol.pack_hashes: little-endian uint64) and its length in
    # tokens; None on a segment lookup (``segments``).
    hashes: bytes | None = None
    num_tokens: int = 0
    # Blending (docs/blend.md): each reusable segment's chunk keys (pack_hashes); the rank says
    # which segments it holds whole in its local tiers (pinned for the load) and, with
    # ``fetch_missing``, which of the others a peer or the remote store offers whole.
    segments: list[bytes] | None = None
    # The request's LoRA adapter, [name, lora_id] (adapter_id.py), on the full request only: the
    # rank reports it to the controller, which keys requests naming the adapter the same way.
    lora: list[str] | None = None
    # Pull before grant: start pulling what is offered now, and say so (PullEnded) once it ended;
    # ``settle``: answer what the local tiers hold now, the offer's pull ended or given up.
    pull_now: bool = False
    settle: bool = False


class PullEnded(msgspec.Struct, tag="pull_ended"):
    """A rank's word, unasked, that the pull a ``pull_now`` lookup started for ``req_id`` ended."""

    req_id: str
    tp_rank: int


class LookupReply(msgspec.Struct, tag="lookup_reply"):
    seq: int
    req_id: str
    hit_tokens: int = 0
    error: str = ""
    segments_held: list[bool] | None = None  # a segment lookup's answer, one per segment
    segments_offered: list[bool] | None = None  # not held, offered whole: the blended load pulls it first
    # Where the hit's last chunk held in host memory ends (tokens; 0: none): loading up to there
    # crosses PCIe. Only a rank whose KV cache is on a GPU counts it (a CPU engine's loads cross none).
    host_until: int = 0
    fetched: bool = False  # part of the hit is fetched for this lookup (a peer pull, the remote store)
    # Each chunk of the hit's source (pack_sources): the tier it is loaded from, or p2p / the
    # remote store where this lookup fetched it; vLLM counts hits by source.
    chunk_sources: bytes = b""
    # The hit past this token is an offer (a peer's, the remote store's): the load pulls it
    # first, beside the engine's steps (-1: the whole hit is held here).
    pull_from: int = -1
    pulling: bool = False  # the rank pulls the offer now (pull_now) and sends PullEnded when it ends


@dataclass
class SegmentHits:
    """A segment lookup's answer over every rank, one entry per segment: whether the blended load
    can use it (each rank holds it whole or has it offered whole), and whether a rank pulls it first."""

    usable: list[bool]
    pulled: list[bool]

    @property
    def pulls(self) -> bool:
        return any(self.pulled)


def pack_sources(sources: list[str]) -> bytes:
    """Hit sources (``vocab.HIT_SOURCES`` names), one byte a chunk."""
    return bytes(HIT_SOURCES.index(source) for source in sources)


def unpack_sources(packed: bytes) -> tuple[str, ...]:
    return tuple(HIT_SOURCES[i] if i < len(HIT_SOURCES) else SOURCE_REMOTE for i in packed)


def merge_sources(per_rank: list[tuple[str, ...]], chunks: int) -> tuple[str, ...]:
    """The hit's sources over the ranks: for each chunk the one farthest from the GPU (the ranks
    load their shares of a chunk at once; the slowest one's tier is the chunk's)."""
    if not any(per_rank):
        return ()  # no rank said (a hit of nothing)
    merged = []
    for index in range(chunks):
        known = [sources[index] for sources in per_rank if index < len(sources)]
        merged.append(max(known, key=HIT_SOURCES.index) if known else SOURCE_REMOTE)
    return tuple(merged)


@dataclass(frozen=True)
class Hit:
    """The ranks' answer to a lookup: the tokens every rank can load, where the part of them
    any rank holds in host memory ends (0: all in GPU memory, or a CPU engine), whether any
    rank fetches part of them for this lookup, and each chunk's hit source."""

    tokens: int
    host_until: int = 0
    fetched: bool = False
    sources: tuple[str, ...] = ()
    pull_from: int | None = None  # some rank pulls the hit past this token when it loads (an offer)
    # The ranks pulling now (pull_now) what the hit counts (past pull_from): each sends PullEnded.
    pulling_ranks: frozenset[int] = frozenset()


def tokens_by_source(sources: tuple[str, ...], start: int, end: int, chunk_size: int) -> dict[str, int]:
    """How many of the tokens ``[start, end)`` came from each source, ``sources`` naming one a
    chunk from token 0."""
    counts: dict[str, int] = {}
    for index, source in enumerate(sources):
        overlap = min(end, (index + 1) * chunk_size) - max(start, index * chunk_size)
        if overlap > 0:
            counts[source] = counts.get(source, 0) + overlap
    return counts


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(LookupRequest)
_reply_decoder = msgspec.msgpack.Decoder(LookupReply)
_ended_decoder = msgspec.msgpack.Decoder(PullEnded)


def socket_path(engine_id: str, dp_rank: int, tp_rank: int) -> str:
    """One ipc path per (engine, DP rank, TP rank): named by a hash of the whole engine id (ids
    of engines on one host may share any prefix), short enough for the 107-byte sun_path."""
    tag = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    return os.path.join(tempfile.gettempdir(), f"lmcache-p2p-{tag}-dp{dp_rank}-tp{tp_rank}.ipc")


def engine_socket_path(vllm_config, tp_rank: int) -> str:
    """The path for ``tp_rank`` of the engine ``vllm_config`` describes (both halves derive it)."""
    dp_rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    return socket_path(str(vllm_config.kv_transfer_config.engine_id), dp_rank, tp_rank)


def pull_ended_path(vllm_config) -> str:
    """Where the scheduler of the engine ``vllm_config`` describes takes its ranks' PullEnded words."""
    return engine_socket_path(vllm_config, 0).removesuffix("-tp0.ipc") + "-ended.ipc"


def _remove_if_stale(path: str) -> None:
    """Remove the socket file at ``path`` if no process listens on it (one that died left it;
    binding over it would fail). A live one belongs to another engine with the same id on this
    host: binding over it would take that engine's lookups, so it is refused."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        logger.info("lookup socket %s was left by a process that is gone: removed", path)
        return
    except OSError as e:
        raise OSError(e.errno, f"lookup socket {path} exists and cannot be probed ({e.strerror}); remove it") from None
    finally:
        probe.close()
    raise OSError(
        errno.EADDRINUSE,
        f"lookup socket {path} is held by another live process: another engine on this host has the same "
        "engine_id (kv_transfer_config's engine_id); give each engine its own, or stop the other one",
    )


class LookupServer:
    """Answers lookups on one rank, on its own thread, with ``handler(request) -> reply``."""

    def __init__(self, path: str, handler: Callable[[LookupRequest], LookupReply]):
        self.path = path
        self._handler = handler
        self._ctx: zmq.Context = zmq.Context.instance()
        _remove_if_stale(path)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"ipc://{path}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmcache-lookup-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                ident, payload = self._sock.recv_multipart()
            except ValueError:
                logger.warning("lookup server: dropped a frame that is not [identity, payload]")
                continue
            except zmq.ZMQError:
                break
            try:
                request = _request_decoder.decode(payload)
            except msgspec.DecodeError as exc:
                logger.warning("lookup server: dropped a bad lookup request (%d bytes): %s", len(payload), exc)
                continue
            try:
                reply = self._handler(request)
            except Exception as exc:  # a lookup problem is a miss, never a dead lookup thread
                logger.exception("lookup of request %s failed; answering a miss", request.req_id)
                reply = LookupReply(seq=request.seq, req_id=request.req_id, error=str(exc))
            try:
                self._sock.send_multipart([ident, _encoder.encode(reply)])
            except zmq.ZMQError as exc:
                logger.warning("lookup server: could not answer request %s: %s", request.req_id, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class PullEndedSender:
    """A rank's PullEnded words to its scheduler, sent from whichever thread ended the pull (a
    lock keeps one thread on the socket at a time)."""

    def __init__(self, path: str, tp_rank: int):
        self.tp_rank = tp_rank
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.connect(f"ipc://{path}")
        self._lock = threading.Lock()

    def send(self, req_id: str) -> None:
        with self._lock:
            try:
                self._sock.send(_encoder.encode(PullEnded(req_id, self.tp_rank)), zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the scheduler gives up waiting at its deadline
                logger.warning("could not tell the scheduler that request %s's pull ended: %s", req_id, exc)

    def close(self) -> None:
        with self._lock:
            self._sock.close(0)


class LookupClient:
    """Asks every TP rank of this engine; used by the scheduler-side connector."""

    def __init__(self, paths: list[str], chunk_size: int, ended_path: str | None = None):
        self.chunk_size = chunk_size  # a reply's chunk_sources name one source per chunk of the hit
        self._ctx: zmq.Context = zmq.Context.instance()
        # The ranks' PullEnded words (pull_before_grant): bound here, the ranks connect.
        self._ended: zmq.Socket | None = None
        self._ended_path = ended_path
        if ended_path is not None:
            _remove_if_stale(ended_path)
            self._ended = self._ctx.socket(zmq.PULL)
            self._ended.setsockopt(zmq.LINGER, 0)
            self._ended.bind(f"ipc://{ended_path}")
        self._socks: list[zmq.Socket] = []
        for path in paths:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{path}")
            self._socks.append(sock)
        self._poller = zmq.Poller()
        for sock in self._socks:
            self._poller.register(sock, zmq.POLLIN)
        self._seq = 0
        # Requests whose lookup asked the ranks to pull now -> the ranks that said the pull ended
        # (a word for any other request is late: its request finished, or was settled).
        self._pulls_ended: dict[str, set[int]] = {}

    def pulls_ended(self, req_id: str, ranks: frozenset[int]) -> bool:
        """Whether every one of ``ranks`` said the pull a ``pull_now`` lookup of ``req_id`` started
        ended (the words that came since are read here, without waiting)."""
        while self._ended is not None:
            try:
                payload = self._ended.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                word = _ended_decoder.decode(payload)
            except msgspec.DecodeError as exc:
                logger.warning("lookup client: dropped a bad PullEnded word (%d bytes): %s", len(payload), exc)
                continue
            if word.req_id in self._pulls_ended:  # (else late: its request finished, or was settled)
                self._pulls_ended[word.req_id].add(word.tp_rank)
        return ranks <= self._pulls_ended.get(req_id, set())

    def forget_pull(self, req_id: str) -> None:
        self._pulls_ended.pop(req_id, None)

    def lookup(
        self,
        req_id: str,
        chunk_hashes: np.ndarray,
        num_tokens: int,
        fetch_missing: bool,
        timeout_s: float,
        lora: tuple[str, str] | None = None,
        pull_now: bool = False,
        settle: bool = False,
    ) -> Hit:
        """What every rank can load of the prompt ``chunk_hashes`` (uint64) names, its offers
        included. A rank that does not answer within ``timeout_s`` makes it a miss. ``lora``: the
        request's adapter (name, lora_id), which the ranks report to the controller.
        ``pull_now``: the ranks start pulling what is offered (:meth:`pulls_ended` tells when it
        ended); ``settle``: they answer what they hold now, giving up a pull still running."""
        self._seq += 1
        seq = self._seq
        if pull_now:  # (a short pull's word may come before the answers)
            self._pulls_ended.setdefault(req_id, set())
        payload = _encoder.encode(
            LookupRequest(
                seq=seq,
                req_id=req_id,
                fetch_missing=fetch_missing,
                hashes=pack_hashes(chunk_hashes),
                num_tokens=num_tokens,
                lora=list(lora) if lora is not None else None,
                pull_now=pull_now,
                settle=settle,
            )
        )
        for sock in self._socks:
            sock.send(payload, copy=False)
        answers: dict[int, LookupReply] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(self._socks):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                missing = [r for r in range(len(self._socks)) if r not in answers]
                logger.warning(
                    "lookup of request %s: TP rank(s) %s did not answer within %.1f s; treating it as a miss",
                    req_id,
                    missing,
                    timeout_s,
                )
                self.forget_pull(req_id)
                return Hit(0)
            for sock, _ in self._poller.poll(left_ms):
                reply = self._decode(sock.recv())
                if reply is None or reply.seq != seq:  # older seqs: answers we gave up on
                    continue
                answers[self._socks.index(sock)] = reply
        for rank, answer in answers.items():
            if answer.error:
                logger.warning(
                    "lookup of request %s: rank %d failed (%s); treating it as a miss", req_id, rank, answer.error
                )
                self.forget_pull(req_id)
                return Hit(0)
        tokens = min(a.hit_tokens for a in answers.values())
        host_until = min(tokens, max(a.host_until for a in answers.values()))
        chunks = -(-tokens // self.chunk_size)
        sources = merge_sources([unpack_sources(a.chunk_sources) for a in answers.values()], chunks)
        pulls = [a.pull_from for a in answers.values() if 0 <= a.pull_from < tokens]
        fetched = any(a.fetched for a in answers.values())
        pull_from = min(pulls) if pulls else None
        # A rank pulling only past the hit (another rank holds less) adds nothing to wait for.
        pulling = frozenset(r for r, a in answers.items() if a.pulling and 0 <= a.pull_from < tokens)
        if not pulling:
            self.forget_pull(req_id)
        return Hit(tokens, host_until, fetched, sources, pull_from, pulling)

    def lookup_segments(
        self, req_id: str, segments: list[np.ndarray], fetch_missing: bool, timeout_s: float
    ) -> SegmentHits:
        """Which of ``segments`` (each a segment's chunk keys) every rank can blend: held whole in
        its local tiers (pinned there for the load) or, with ``fetch_missing``, offered whole by a
        peer or the remote store (the blended load pulls it first, beside the steps). A rank
        that does not answer, or fails, holds none."""
        self._seq += 1
        seq = self._seq
        payload = _encoder.encode(
            LookupRequest(
                seq=seq,
                req_id=req_id,
                fetch_missing=fetch_missing,
                segments=[pack_hashes(keys) for keys in segments],
            )
        )
        for sock in self._socks:
            sock.send(payload, copy=False)
        none = SegmentHits([False] * len(segments), [False] * len(segments))
        usable, pulled = [True] * len(segments), [False] * len(segments)
        answered = 0
        deadline = time.monotonic() + timeout_s
        while answered < len(self._socks):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                logger.warning("segment lookup of request %s: a TP rank did not answer; treating it as a miss", req_id)
                return none
            for sock, _ in self._poller.poll(left_ms):
                reply = self._decode(sock.recv())
                if reply is None or reply.seq != seq:
                    continue
                answered += 1
                held = reply.segments_held
                offered = reply.segments_offered or [False] * len(segments)
                if reply.error or held is None or len(held) != len(segments) or len(offered) != len(segments):
                    logger.warning("segment lookup of request %s failed on a rank (%s)", req_id, reply.error)
                    return none
                for i, (here, there) in enumerate(zip(held, offered, strict=True)):
                    usable[i] = usable[i] and (here or there)
                    pulled[i] = pulled[i] or (there and not here)
        return SegmentHits(usable, [u and p for u, p in zip(usable, pulled, strict=True)])

    @staticmethod
    def _decode(payload: bytes) -> LookupReply | None:
        try:
            return _reply_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            logger.warning("lookup client: dropped a bad reply (%d bytes): %s", len(payload), exc)
            return None

    def close(self) -> None:
        for sock in self._socks:
            sock.close(0)
        if self._ended is not None:
            self._ended.close(0)
            assert self._ended_path is not None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ended_path)
