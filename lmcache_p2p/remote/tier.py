"""RemoteTier: the storage manager's view of a shared store (``remote_url``), below CPU and disk.

What it adds to a bare :class:`RemoteStore`:

* **Keys carry the layout.** ``lmcache-p2p:v1:<layout digest>:<chunk hash>``: the digest covers
  model, dtype, block shape, TP size and rank (``LayoutFingerprint``), so two models or two
  ranks never read each other's bytes. Keys have no hash tag, so a Redis Cluster spreads them.
* **Values are framed and checked.** A 40-byte header (magic, version, flags, layout digest,
  chunk hash, payload length, XXH3 of the payload) precedes the raw page (``remote_serde:
  naive``). A read whose header or checksum does not match is a miss, logged and counted.
* **Values are authenticated with the mesh secret.** With one (the store's URL carries the
  config's), every value written carries a 32-byte HMAC-SHA256 tag over its key, header and
  payload (flag :data:`FLAG_MAC`; the tag sits between header and payload), keyed from the
  secret (:class:`~lmcache_p2p.remote.auth.ValueMac`). A reader with the secret refuses any
  value whose tag does not match, or that has none, as a miss: counted (``mac_failures``) and
  logged at most once a minute with the key and the store. XXH3 catches bit rot; only the tag
  stops a stranger who can write to the store, since anyone can compute an XXH3. A reader
  without a secret skips the tag and checks the rest: it loads whatever well-formed value it
  finds, a stranger's included.
* **Writes are behind.** The CPU tier's admits are queued (bounded; a full queue drops and
  counts) and written by one thread in batches, after one ``exists`` round that skips chunks
  another instance already wrote. The engine's store path only appends a key to a queue.
* **Reads are one round per lookup**, then batched gets: :meth:`prefix_length` is one pipelined
  ``exists`` for the whole prefix; :meth:`fetch` gets the values in batches of at most
  ``FETCH_BATCH_BYTES`` and hands each checked payload to the caller (the storage manager copies
  it into a CPU page).
* **An outage is a miss.** Any :class:`RemoteUnavailable` marks the tier down for a back-off
  (1 s, doubling to 30 s); meanwhile lookups answer 0 without a round trip and writes are
  dropped (counted). The first call after the back-off tries again: the tier reconnects by itself.
  One WARNING per outage and one INFO on recovery, with the reason and the numbers.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from lmcache_p2p.keys import KEY_FORMAT, ChunkKey, payload_checksum
from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.remote.auth import MAC_BYTES, ValueMac
from lmcache_p2p.remote.store import RemoteRefused, RemoteStore
from lmcache_p2p.vocab import CPU
from lmcache_p2p.write_behind import WriteBehind

if TYPE_CHECKING:
    from lmcache_p2p.storage.cpu_tier import PinnedChunk

logger = logging.getLogger(__name__)

KEY_PREFIX = b"lmcache-p2p:v1:"
# magic, version, flags, layout digest, chunk hash, payload bytes, XXH3-64 of the payload
HEADER = struct.Struct("<4sHHQQQQ")
MAGIC = b"LMKV"
VERSION = 1
HEADER_BYTES = HEADER.size  # 40 bytes
# Flags (the header's third field, 0 in every value written before MACs): FLAG_MAC says a
# MAC_BYTES tag follows the header. A reader that does not know a flag refuses the value (an
# older reader finds the payload MAC_BYTES longer than a page: a counted miss, never bad KV).
FLAG_MAC = 0x0001
# FLAG_KEY_FORMAT_2: written by an engine keying chunks by key format 2 (keys.KEY_FORMAT: the
# request's cache_salt, adapter and multimodal items in its keys). Readers from before format 2
# do not know the flag and refuse such values, so an old engine never loads a new one's chunk.
# A value without it was written by an older engine: read (plain keys are the same under both
# formats, so nothing is flushed on upgrade) and counted (legacy_values_read; docs/security.md).
FLAG_KEY_FORMAT_2 = 0x0002
KNOWN_FLAGS = FLAG_MAC | FLAG_KEY_FORMAT_2

# One get round moves at most this much (a 40-chunk prompt of 32 MiB pages is 1.3 GB: the
# values of one round sit in this process's memory until copied into pages).
FETCH_BATCH_BYTES = 256 * 2**20
WRITE_BATCH_CHUNKS = 16
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0


def remote_key(key: ChunkKey) -> bytes:
    return b"%s%016x:%016x" % (KEY_PREFIX, key.fingerprint, key.chunk_hash)


def frame_value(
    key: ChunkKey, payload: np.ndarray, checksum: int, mac: ValueMac | None = None, key_format: int = KEY_FORMAT
) -> bytearray:
    """Header (+ tag, with ``mac``) + payload (a page's uint8 array) in one buffer: the one copy a
    write makes. The tag is computed over the copy, so it covers the bytes that are sent.
    ``key_format``: the writer's (its layout's); 2 and later set :data:`FLAG_KEY_FORMAT_2`."""
    offset = HEADER_BYTES + (MAC_BYTES if mac is not None else 0)
    out = bytearray(offset + payload.nbytes)
    flags = (FLAG_MAC if mac is not None else 0) | (FLAG_KEY_FORMAT_2 if key_format >= 2 else 0)
    HEADER.pack_into(out, 0, MAGIC, VERSION, flags, key.fingerprint, key.chunk_hash, payload.nbytes, checksum)
    np.frombuffer(out, dtype=np.uint8, offset=offset)[:] = payload.reshape(-1).view(np.uint8)
    if mac is not None:
        view = memoryview(out)
        view[HEADER_BYTES:offset] = mac.tag(remote_key(key), view[:HEADER_BYTES], view[offset:])
    return out


class BadValue(Exception):
    """A stored value that is not this chunk's page (another layout, truncated, bit rot)."""


class MacFailure(BadValue):
    """A value this reader cannot authenticate: no tag, or one its mesh secret does not give.
    Whoever wrote it did not hold the secret (a stranger with access to the store, or an engine
    with another secret or none)."""


def value_key_format(value: bytes | memoryview) -> int:
    """The key format a (checked) value was written under: 2 with :data:`FLAG_KEY_FORMAT_2`, else 1."""
    return 2 if HEADER.unpack_from(value, 0)[2] & FLAG_KEY_FORMAT_2 else 1


def unframe_value(
    key: ChunkKey, value: bytes | memoryview, page_bytes: int, mac: ValueMac | None = None
) -> tuple[memoryview, int]:
    """The payload and its checksum, checked against ``key`` and the page size, and with ``mac``
    authenticated first; :class:`MacFailure` or :class:`BadValue` saying what differs otherwise.
    Without ``mac`` a value's tag is skipped, unchecked."""
    view = memoryview(value)
    if view.nbytes < HEADER_BYTES:
        raise BadValue(f"{view.nbytes} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, flags, fingerprint, chunk_hash, length, checksum = HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise BadValue(f"not a v{VERSION} lmcache-p2p value (magic {magic!r}, version {version})")
    if flags & ~KNOWN_FLAGS:
        raise BadValue(f"unknown flags {flags:#06x} (this reader knows {KNOWN_FLAGS:#06x})")
    offset = HEADER_BYTES + (MAC_BYTES if flags & FLAG_MAC else 0)
    if length != page_bytes or view.nbytes - offset != length:
        raise BadValue(f"payload {view.nbytes - offset} bytes (header {length}), page is {page_bytes}")
    payload = view[offset:]
    if mac is not None:
        if not flags & FLAG_MAC:
            raise MacFailure("it has no MAC: written without the mesh secret")
        if not mac.verify(remote_key(key), view[:HEADER_BYTES], payload, view[HEADER_BYTES:offset]):
            raise MacFailure("its MAC does not match: written with another mesh secret, or forged")
    if (fingerprint, chunk_hash) != (key.fingerprint, key.chunk_hash):
        raise BadValue(f"header names {fingerprint:016x}:{chunk_hash:016x}")
    actual = payload_checksum(payload)
    if actual != checksum:
        raise BadValue(f"checksum {actual:016x} != stored {checksum:016x}")
    return payload, checksum


@dataclass
class RemoteCounters:
    lookups: int = 0
    lookup_chunks_hit: int = 0
    chunks_read: int = 0
    bytes_read: int = 0
    chunks_written: int = 0
    bytes_written: int = 0
    writes_already_there: int = 0  # another instance wrote it first: skipped after the exists round
    writes_dropped_down: int = 0  # queued while the store was down, or in a batch that failed
    writes_missed: int = 0  # left the CPU tier before its turn
    writes_refused: int = 0  # the store answered with an error (out of memory, value too large)
    bad_values: int = 0
    mac_failures: int = 0  # values refused because the mesh secret does not authenticate them
    # Values read that an engine from before key format 2 wrote (no FLAG_KEY_FORMAT_2): plain
    # keys, but an old engine keyed salted, LoRA and multimodal requests plainly too.
    legacy_values_read: int = 0
    errors: int = 0
    last_error: str = ""
    read_s: float = field(default=0.0, repr=False)
    write_s: float = field(default=0.0, repr=False)


class PageSink(Protocol):
    """What a prefix fetch fills: a chunk store's CPU pages (storage.manager.StorageManager)."""

    chunk_size: int

    @property
    def cpu_pages_unpinned(self) -> int: ...

    def key(self, chunk_hash: int) -> ChunkKey: ...

    def holds(self, chunk_hash: int, location: str) -> bool: ...

    def reserve_page(self) -> tuple[int, Any] | None: ...

    def commit_page(
        self, chunk_hash: int, page: int, checksum: int | None = None, location: str = CPU, from_remote: bool = False
    ) -> bool: ...


class RemoteTier:
    def __init__(
        self,
        store: RemoteStore,
        page_bytes: int,
        write_queue_chunks: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        key_format: int = KEY_FORMAT,
    ):
        self.store = store
        self.key_format = key_format  # the writers' layout's: FLAG_KEY_FORMAT_2 from 2 on
        self.page_bytes = page_bytes
        self.counters = RemoteCounters()
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until = 0.0  # no round trips before this (monotonic)
        self._backoff_s = 0.0  # 0 while up
        self._down_since = 0.0
        self._write_queue_chunks = write_queue_chunks
        self._pin: Callable[[ChunkKey], PinnedChunk | None] | None = None
        self._refused_log = RateLimitedLog(logger, every_s=60.0)
        self._mac_log = RateLimitedLog(logger, every_s=60.0)
        self._writes: WriteBehind | None = None  # started by start_writer
        # With the mesh secret (carried by the store's URL) values are written with a MAC and
        # read only with a matching one; without, neither.
        secret = store.url.mesh_secret
        self._mac = ValueMac(secret) if secret else None
        self._value_bytes = HEADER_BYTES + (MAC_BYTES if self._mac is not None else 0) + page_bytes

    @property
    def name(self) -> str:
        return self.store.url.describe()

    # -- health ----------------------------------------------------------------------------------

    def is_up(self) -> bool:
        return self._clock() >= self._down_until

    def connect(self) -> None:
        """Open the store's connection (one ping) before the first lookup needs it; a store down
        now is marked down, as a failed round would mark it."""
        try:
            took = self.store.ping()
        except Exception as e:  # as in prefix_length: the store's failure is an outage, never the engine's error
            self._failed("connect", e)
            return
        self._succeeded()
        logger.info("remote tier %s connected (ping %.2f ms)", self.name, took * 1e3)

    def _failed(self, doing: str, error: Exception) -> None:
        with self._lock:
            self.counters.errors += 1
            self.counters.last_error = f"{doing}: {error}"
            first = self._backoff_s == 0.0
            self._backoff_s = BACKOFF_FIRST_S if first else min(BACKOFF_MAX_S, self._backoff_s * 2)
            now = self._clock()
            self._down_until = now + self._backoff_s
            if first:
                self._down_since = now
        if first:
            logger.warning(
                "remote tier %s unavailable (%s: %s): lookups are misses and writes are dropped; retrying in %.0f s",
                self.name,
                doing,
                error,
                self._backoff_s,
            )
        else:
            logger.debug(
                "remote tier %s still unavailable (%s: %s); next try in %.0f s",
                self.name,
                doing,
                error,
                self._backoff_s,
            )

    def _succeeded(self) -> None:
        if self._backoff_s == 0.0:
            return
        with self._lock:
            down_for = self._clock() - self._down_since
            self._backoff_s = 0.0
            self._down_until = 0.0
        logger.info("remote tier %s is back after %.1f s", self.name, down_for)

    # -- reads -----------------------------------------------------------------------------------

    def prefix_length(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the store holds: one pipelined ``exists`` round (0 while down)."""
        if not keys or not self.is_up():
            return 0
        t0 = time.perf_counter()
        try:
            held = self.store.exists([remote_key(k) for k in keys])
        except Exception as e:  # any failure of the store is a miss and an outage, never the engine's error
            self._failed("exists", e)
            return 0
        self._succeeded()
        n = next((i for i, present in enumerate(held) if not present), len(keys))
        self.counters.lookups += 1
        self.counters.lookup_chunks_hit += n
        logger.debug(
            "remote tier %s holds %d of %d leading chunks (exists round %.2f ms)",
            self.name,
            n,
            len(keys),
            (time.perf_counter() - t0) * 1e3,
        )
        return n

    def fetch(self, keys: Sequence[ChunkKey]) -> Iterator[tuple[ChunkKey, memoryview, int]]:
        """Each of ``keys`` in order as (key, checked payload, checksum), in get rounds of at most
        ``FETCH_BATCH_BYTES``; stops at the first chunk that is gone, bad or unreachable."""
        per_round = max(1, FETCH_BATCH_BYTES // self._value_bytes)
        for start in range(0, len(keys), per_round):
            batch = keys[start : start + per_round]
            t0 = time.perf_counter()
            try:
                values = self.store.get([remote_key(k) for k in batch])
            except Exception as e:
                self._failed("get", e)
                return
            self._succeeded()
            self.counters.read_s += time.perf_counter() - t0
            for key, value in zip(batch, values, strict=True):
                if value is None:
                    logger.info("remote tier %s: %s is gone (evicted since the exists round)", self.name, key)
                    return
                try:
                    payload, checksum = unframe_value(key, value, self.page_bytes, self._mac)
                except MacFailure as e:
                    self._refuse_unauthenticated(key, str(e))
                    return
                except BadValue as e:
                    self.counters.bad_values += 1
                    logger.warning(
                        "remote tier %s: value of %s is unusable (%s); treating it as a miss", self.name, key, e
                    )
                    return
                self.counters.chunks_read += 1
                self.counters.bytes_read += payload.nbytes
                if value_key_format(value) < 2:
                    self.counters.legacy_values_read += 1
                yield key, payload, checksum

    def _refuse_unauthenticated(self, key: ChunkKey, why: str) -> None:
        self.counters.mac_failures += 1
        self._mac_log.warning(
            "mac",
            "remote tier %s: value of %s (%s) failed authentication: %s; treating it as a miss (%d in all). "
            "Whoever can write to the store can poison it: give every engine the same mesh secret and keep "
            "strangers off the store",
            self.name,
            key,
            remote_key(key).decode(),
            why,
            self.counters.mac_failures,
        )

    def fetch_prefix_into(
        self,
        storage: PageSink,
        chunk_hashes: Sequence[int],
        held: int | None = None,
        on_landed: Callable[[int], object] | None = None,
    ) -> int:
        """Copy the leading chunks of ``chunk_hashes`` the store holds into ``storage``'s CPU tier:
        one ``exists`` round (skipped where ``held`` says how many it holds: an offer's lookup
        asked already), then batched gets; returns how many leading chunks are now held locally
        (0 with the store down or the first chunk missing). ``on_landed`` is told how many are
        held so far after each chunk (a load copies those while the rest arrive)."""
        if not len(chunk_hashes):
            return 0
        t0 = time.perf_counter()
        keys = [storage.key(h) for h in chunk_hashes]
        held = self.prefix_length(keys) if held is None else min(held, len(keys))
        # More than the pool can hold unpinned would evict this prompt's own first chunks.
        wanted = min(held, storage.cpu_pages_unpinned)
        if wanted < held:
            logger.info(
                "remote tier %s holds %d chunk(s) of this prompt; fetching the %d the CPU pool has room for",
                self.name,
                held,
                wanted,
            )
        t_exists = time.perf_counter() - t0
        done = 0
        for key, value, checksum in self.fetch(keys[:wanted]):
            if not storage.holds(key.chunk_hash, CPU):
                reserved = storage.reserve_page()
                if reserved is None:
                    break
                page, data = reserved
                data.numpy()[:] = np.frombuffer(value, dtype=np.uint8)
                storage.commit_page(key.chunk_hash, page, checksum, from_remote=True)
            done += 1
            if on_landed is not None:
                on_landed(done)
        took = time.perf_counter() - t0
        if wanted:
            nbytes = done * self.page_bytes
            logger.info(
                "remote tier %s: fetched %d of %d chunk(s) (%d tokens, %.1f MiB) in %.1f ms "
                "(exists round %.1f ms, %.2f GB/s)",
                self.name,
                done,
                wanted,
                done * storage.chunk_size,
                nbytes / 2**20,
                took * 1e3,
                t_exists * 1e3,
                nbytes / 1e9 / max(took - t_exists, 1e-9),
            )
        return done

    # -- writes ----------------------------------------------------------------------------------

    def start_writer(self, pin: Callable[[ChunkKey], PinnedChunk | None]) -> None:
        """Write queued keys behind, reading each page with ``pin(key)`` (a ``PinnedChunk`` or
        None once evicted)."""
        self._pin = pin
        self._writes = WriteBehind(f"remote {self.name}", self._write_queue_chunks, self._write, WRITE_BATCH_CHUNKS)

    def submit(self, key: ChunkKey) -> None:
        """Queue ``key`` for writing; never blocks (a full queue drops and counts)."""
        if not self.is_up():
            self.counters.writes_dropped_down += 1
            return
        assert self._writes is not None, "start_writer() first"
        self._writes.submit(key)

    def _write(self, keys: list[ChunkKey]) -> None:
        if (self._writes is not None and self._writes.stopping) or not self.is_up():
            self.counters.writes_dropped_down += len(keys)
            return
        t0 = time.perf_counter()
        names = [remote_key(k) for k in keys]
        try:
            held = self.store.exists(names)
        except Exception as e:
            self._failed("exists before write", e)
            self.counters.writes_dropped_down += len(keys)
            return
        self._succeeded()
        items: list[tuple[bytes, bytearray]] = []
        assert self._pin is not None
        for key, name, present in zip(keys, names, held, strict=True):
            if present:
                self.counters.writes_already_there += 1
                continue
            chunk = self._pin(key)
            if chunk is None:
                self.counters.writes_missed += 1
                continue
            with chunk:
                items.append((name, frame_value(key, chunk.data.numpy(), chunk.checksum, self._mac, self.key_format)))
        if not items:
            return
        try:
            self.store.put(items)
        except RemoteRefused as e:
            # The store answered: reads stay on. What it accepted of the batch is not known
            # here; the next writer's exists round sees it.
            self.counters.writes_refused += len(items)
            self._refused_log.warning(
                "put",
                "remote tier %s refused a write of %d chunk(s) (%s); they stay local only",
                self.name,
                len(items),
                e,
            )
            return
        except Exception as e:
            self._failed("put", e)
            self.counters.writes_dropped_down += len(items)
            return
        self._succeeded()
        took = time.perf_counter() - t0
        nbytes = sum(len(v) for _, v in items)
        self.counters.chunks_written += len(items)
        self.counters.bytes_written += nbytes
        self.counters.write_s += took
        logger.debug(
            "remote tier %s: wrote %d chunk(s), %.1f MiB in %.1f ms (%.2f GB/s)",
            self.name,
            len(items),
            nbytes / 2**20,
            took * 1e3,
            nbytes / 1e9 / max(took, 1e-9),
        )

    def flush(self, timeout: float = 30.0) -> bool:
        return self._writes.flush(timeout) if self._writes is not None else True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued within ``timeout`` (one deadline for the whole close), drop the
        rest (counted), stop the writer, close the store."""
        if self._writes is not None:
            self.counters.writes_dropped_down += self._writes.close(timeout)
        try:
            self.store.close()
        except Exception as e:  # closing a broken connection must not fail a shutdown
            logger.debug("closing remote store %s: %s", self.name, e)

    def stats(self) -> dict:
        c = self.counters
        return {
            "url": self.name,
            "up": self.is_up(),
            "lookups": c.lookups,
            "lookup_chunks_hit": c.lookup_chunks_hit,
            "chunks_read": c.chunks_read,
            "bytes_read": c.bytes_read,
            "read_gbps": round(c.bytes_read / 1e9 / c.read_s, 3) if c.read_s else None,
            "chunks_written": c.chunks_written,
            "bytes_written": c.bytes_written,
            "write_gbps": round(c.bytes_written / 1e9 / c.write_s, 3) if c.write_s else None,
            "writes_already_there": c.writes_already_there,
            "writes_dropped_queue_full": self._writes.dropped if self._writes is not None else 0,
            "writes_dropped_down": c.writes_dropped_down,
            "writes_missed": c.writes_missed,
            "writes_refused": c.writes_refused,
            "write_queue": self._writes.queued if self._writes is not None else 0,
            "bad_values": c.bad_values,
            "values_authenticated": self._mac is not None,
            "mac_failures": c.mac_failures,
            "legacy_values_read": c.legacy_values_read,
            "errors": c.errors,
            "last_error": c.last_error,
        }
