"""A LoRA adapter's identity for chunk keys: ``lora_id``, a digest of its path and its weights.

vLLM keys a LoRA request's blocks by the adapter's name and path (0.32; the name alone before).
Our keys are shared across hosts, where one name and one path may hold different weights, so the
id covers the weights too::

    weights_digest = BLAKE2b-128 over each file of the adapter directory (not recursive), sorted by
                     name, taking adapter_config.json and *.safetensors / *.bin / *.pt:
                     name, NUL, size as u64 LE, the file's bytes
    lora_id        = BLAKE2b-128(person "lmcache-lora", lora_path as given (UTF-8), NUL, weights_digest)

so two adapters with one name on two hosts never share chunks unless their files are the same
and vLLM was given the same path string for them. The id is hashed once per version of the
adapter's files (:class:`AdapterIds` caches it by each file's size, mtime and inode), so a
request costs a directory listing and a few ``stat`` calls. An adapter replaced in place gets a
new id. ``lmcache-p2p adapter-id PATH`` prints it, for comparing hosts.

Torch-free and vLLM-free: the CLI and tests use it on their own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_PERSON = b"lmcache-lora"
_READ_BYTES = 1 << 20
_CACHED_ADAPTERS = 256


class AdapterUnreadable(Exception):
    """The adapter's files cannot be found or read here: its requests are not keyed."""


@dataclass(frozen=True)
class AdapterId:
    lora_id: str  # 32 hex characters
    directory: str  # where its files were read
    hashed_bytes: int


def _adapter_files(directory: str) -> list[os.DirEntry]:
    try:
        entries = sorted(
            (e for e in os.scandir(directory) if e.is_file() and _counts(e.name)),
            key=lambda e: e.name,
        )
    except OSError as e:
        raise AdapterUnreadable(f"cannot list {directory}: {e.strerror or e}") from None
    names = [e.name for e in entries]
    if CONFIG_FILE not in names:
        raise AdapterUnreadable(f"{directory} has no {CONFIG_FILE}")
    if len(names) == 1:
        raise AdapterUnreadable(f"{directory} has no weight file ({', '.join('*' + s for s in WEIGHT_SUFFIXES)})")
    return entries


def _counts(name: str) -> bool:
    return name == CONFIG_FILE or name.endswith(WEIGHT_SUFFIXES)


def weights_digest(directory: str) -> tuple[bytes, int]:
    """The 16-byte digest of an adapter directory's files (module docstring) and the bytes hashed."""
    digest = hashlib.blake2b(digest_size=16, person=_PERSON)
    total = 0
    for entry in _adapter_files(directory):
        try:
            with open(entry.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                digest.update(entry.name.encode("utf-8") + b"\x00" + struct.pack("<Q", size))
                while block := fh.read(_READ_BYTES):
                    digest.update(block)
                    total += len(block)
        except OSError as e:
            raise AdapterUnreadable(f"cannot read {entry.path}: {e.strerror or e}") from None
    return digest.digest(), total


def lora_id_of(lora_path: str, directory: str) -> tuple[str, int]:
    """``lora_id`` (32 hex characters) of the adapter vLLM was given as ``lora_path`` and whose files
    are in ``directory``, and the bytes hashed."""
    weights, total = weights_digest(directory)
    digest = hashlib.blake2b(lora_path.encode("utf-8") + b"\x00" + weights, digest_size=16, person=_PERSON)
    return digest.hexdigest(), total


def adapter_directory(lora_path: str) -> str:
    """Where the files of the adapter vLLM was given as ``lora_path`` are: the path itself (``~``
    expanded; a relative one from the working directory, as vLLM reads it), else a hub id's
    snapshot in the local Hugging Face cache. Nothing is ever downloaded from here."""
    if not lora_path:
        raise AdapterUnreadable("the adapter has no path")
    expanded = os.path.expanduser(lora_path)
    if os.path.isabs(expanded) or os.path.exists(expanded):
        path = os.path.abspath(expanded)
        if not os.path.isdir(path):
            raise AdapterUnreadable(f"{lora_path} is not a directory here")
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise AdapterUnreadable(f"{lora_path} is not a directory here (and huggingface_hub is not installed)") from None
    try:
        return str(snapshot_download(lora_path, local_files_only=True))
    except Exception as e:  # not a hub id, or not in the local cache
        raise AdapterUnreadable(
            f"{lora_path} is not a directory here nor in the local Hugging Face cache ({type(e).__name__})"
        ) from None


class AdapterIds:
    """lora_id per adapter, hashed once per version of its files: cached by the directory and each
    counted file's (name, size, mtime, inode), so an adapter replaced in place is hashed again."""

    def __init__(self, capacity: int = _CACHED_ADAPTERS):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, AdapterId] = OrderedDict()

    def get(self, name: str, lora_path: str) -> AdapterId:
        """The id of adapter ``name`` given as ``lora_path``; :class:`AdapterUnreadable` when its
        files cannot be found or read here."""
        directory = adapter_directory(lora_path)
        signature = []
        for entry in _adapter_files(directory):
            try:
                st = entry.stat()
            except OSError as e:
                raise AdapterUnreadable(f"cannot stat {entry.path}: {e.strerror or e}") from None
            signature.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
        key = (lora_path, directory, tuple(signature))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        t0 = time.perf_counter()
        lora_id, hashed = lora_id_of(lora_path, directory)
        found = AdapterId(lora_id, directory, hashed)
        logger.info(
            "adapter %s (%s): id %s, %.1f MB hashed in %.2f s",
            name,
            lora_path,
            lora_id[:8],
            hashed / 1e6,
            time.perf_counter() - t0,
        )
        with self._lock:
            self._cache[key] = found
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return found
