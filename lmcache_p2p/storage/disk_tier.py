"""LocalDiskBackend: one file per chunk under ``local_disk``, size-capped, LRU, self-checking.

File layout: ``<root>/<fingerprint:016x>/<chunk_hash:016x>.kv`` holding a 40-byte header
(magic, version, key format, fingerprint, chunk hash, payload length, XXH3 checksum) then the
payload. The key format (keys.KEY_FORMAT) is 0 in files written before key format 2 (the field
was reserved): such files, and format 1's, are read (plain keys did not change) and counted,
``legacy_files_read`` (an engine of format 1 keyed salted and adapter requests plainly too).
Writes go to a temp file in the same directory and are renamed into place, so a reader sees
either the whole old file or the whole new one. A crash or a bad disk can still leave a short or
damaged file; every read checks the header and checksum, and a file that fails is deleted,
logged and reported as a miss, never returned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from lmcache_p2p.keys import KEY_FORMAT, ChunkKey, payload_checksum
from lmcache_p2p.vocab import DISK

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sHHQQQQ")  # magic, version, key format, fingerprint, hash, length, checksum
_MAGIC = b"LMKV"
_VERSION = 1
_SUFFIX = ".kv"


class DiskTier:
    """Chunk files under ``root`` with at most ``capacity_bytes`` of payload+headers on disk."""

    location = DISK

    def __init__(
        self,
        root: str,
        capacity_bytes: int,
        on_evict: Callable[[ChunkKey], None] | None = None,
        key_format: int = KEY_FORMAT,
    ):
        self.root = root
        self.key_format = key_format  # written into each file's header (its writer's layout's)
        self.capacity_bytes = capacity_bytes
        self.on_evict = on_evict
        self._files: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> file size, LRU first
        self._used = 0
        self._lock = threading.Lock()
        self.corrupt_files = 0
        self.evictions = 0
        self.legacy_files_read = 0  # files from before key format 2 (header field 0), read
        os.makedirs(root, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        """Index the files a previous process left, oldest first, so a restart keeps its cache."""
        found = []
        for fp_dir in os.scandir(self.root):
            if not fp_dir.is_dir():
                continue
            for f in os.scandir(fp_dir.path):
                if not f.name.endswith(_SUFFIX):
                    if ".tmp" in f.name:  # a write that never finished
                        _unlink(f.path)
                    continue
                try:
                    key = ChunkKey(int(fp_dir.name, 16), int(f.name[: -len(_SUFFIX)], 16))
                    st = f.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort(key=lambda t: t[0])
        for _, key, size in found:
            self._files[key] = size
            self._used += size
        self._evict_to_fit(0)
        if found:
            logger.info("Disk tier %s: %d chunks, %.3f GB found", self.root, len(self._files), self._used / 2**30)

    def path(self, key: ChunkKey) -> str:
        return os.path.join(self.root, f"{key.fingerprint:016x}", f"{key.chunk_hash:016x}{_SUFFIX}")

    def __len__(self) -> int:
        return len(self._files)

    def contains(self, key: ChunkKey) -> bool:
        return key in self._files

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._files)

    @property
    def used_bytes(self) -> int:
        return self._used

    # -- writes ----------------------------------------------------------------------------------

    def write(self, key: ChunkKey, payload, checksum: int | None = None) -> bool:
        """Store a payload (any bytes-like). False if already held or larger than the cap."""
        view = memoryview(payload).cast("B")
        size = _HEADER.size + len(view)
        if key in self._files:
            return False
        if size > self.capacity_bytes:
            logger.warning(
                "chunk %s (%d bytes) exceeds the disk tier cap (%d bytes); not stored", key, size, self.capacity_bytes
            )
            return False
        if checksum is None:
            checksum = payload_checksum(view)
        self._evict_to_fit(size)
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(
                    _HEADER.pack(
                        _MAGIC, _VERSION, self.key_format, key.fingerprint, key.chunk_hash, len(view), checksum
                    )
                )
                fh.write(view)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            logger.error("disk tier write of %s failed: %s", key, e)
            return False
        with self._lock:
            if key not in self._files:
                self._files[key] = size
                self._used += size
        return True

    def _evict_to_fit(self, incoming: int) -> None:
        victims = []
        with self._lock:
            while self._files and self._used + incoming > self.capacity_bytes:
                key, size = self._files.popitem(last=False)
                self._used -= size
                victims.append(key)
        for key in victims:
            _unlink(self.path(key))
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(key)

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            size = self._files.pop(key, None)
            if size is None:
                return False
            self._used -= size
        _unlink(self.path(key))
        return True

    def clear(self) -> list[ChunkKey]:
        keys = self.keys()
        for key in keys:
            self.remove(key)
        return keys

    # -- reads -----------------------------------------------------------------------------------

    def read_into(self, key: ChunkKey, out) -> int | None:
        """Read a payload into ``out`` (writable bytes-like of exactly the payload size).

        Returns the verified checksum, or None on a miss; a damaged file is deleted and logged.
        """
        if key not in self._files:
            return None
        dest = memoryview(out).cast("B")
        path = self.path(key)
        t0 = time.perf_counter()
        try:
            with open(path, "rb", buffering=0) as fh:
                header = fh.read(_HEADER.size)
                problem = self._check_header(key, header, len(dest))
                if problem is None:
                    got = fh.readinto(dest)
                    if got != len(dest) or fh.read(1):
                        problem = f"payload is {got} bytes, expected {len(dest)}"
        except FileNotFoundError:  # deleted behind our back: the index was wrong, not the data
            self._lost(key)
            return None
        except OSError as e:
            problem = f"read failed: {e}"
        if problem is None:
            _, _, key_format, _, _, _, checksum = _HEADER.unpack(header)
            if payload_checksum(dest) == checksum:
                if key_format < 2:  # 0: written before the field existed
                    self.legacy_files_read += 1
                with self._lock:
                    if key in self._files:
                        self._files.move_to_end(key)
                logger.debug("disk read %s: %d bytes in %.2f ms", key, len(dest), (time.perf_counter() - t0) * 1e3)
                return checksum
            problem = "checksum mismatch"
        self.corrupt_files += 1
        logger.warning("disk tier: %s is damaged (%s); deleted, treated as a miss", path, problem)
        self._lost(key)
        return None

    def read(self, key: ChunkKey, payload_bytes: int) -> bytes | None:
        buf = bytearray(payload_bytes)
        return bytes(buf) if self.read_into(key, buf) is not None else None

    @staticmethod
    def _check_header(key: ChunkKey, header: bytes, expected_len: int) -> str | None:
        if len(header) != _HEADER.size:
            return f"header truncated ({len(header)} bytes)"
        magic, version, _, fp, h, length, _ = _HEADER.unpack(header)
        if magic != _MAGIC or version != _VERSION:
            return f"not a chunk file (magic {magic!r}, version {version})"
        if (fp, h) != (key.fingerprint, key.chunk_hash):
            return "header names another chunk"
        if length != expected_len:
            return f"payload length {length}, expected {expected_len}"
        return None

    def _lost(self, key: ChunkKey) -> None:
        """A chunk we listed is gone or unusable: drop it and tell the owner (an evict event)."""
        if self.remove(key) and self.on_evict is not None:
            self.on_evict(key)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
