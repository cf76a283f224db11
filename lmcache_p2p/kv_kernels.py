"""The CUDA kernels of csrc/, compiled on first use with torch's extension tooling and cached.

``load()`` returns the compiled module, or None where there is no CUDA (CPU machines, CI) or the
build failed; callers then use torch indexing, so the package installs and imports anywhere.
A log line says which path was chosen and why. ``LMCACHE_KV_KERNELS=torch`` forces the fallback,
``=cuda`` makes a failed build an error instead of a fallback.

The build targets the GPU in the machine: Hopper gets ``sm_90a`` code plus ``compute_90`` PTX (any
later GPU JIT-compiles the PTX); others get their own ``sm_XY`` plus PTX. Builds are cached under
``LMCACHE_KERNEL_CACHE`` (default ``~/.cache/lmcache_p2p/kernels``), one directory per source
digest, torch, CUDA and architecture, so a second process loads in well under a second.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)


def _csrc() -> Path:
    here = Path(__file__).resolve().parent
    # Installed: package data under lmcache_p2p/csrc. A source checkout: the repository's csrc/.
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / "kv_transfer.cu").exists():
            return candidate
    return here / "csrc"


# The KV copies (and the module's bindings), then the device checksum of pages.
SOURCES = [_csrc() / name for name in ("kv_transfer.cu", "page_checksum.cu")]


def _arch_flags(capability: tuple[int, int]) -> tuple[str, list[str]]:
    major, minor = capability
    if (major, minor) == (9, 0):
        # sm_90a: Hopper's arch-specific features; the PTX serves newer GPUs.
        return "sm_90a", ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90"]
    arch = f"{major}{minor}"
    return f"sm_{arch}", [
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        f"-gencode=arch=compute_{arch},code=compute_{arch}",
    ]


def _build_dir(arch: str) -> Path:
    root = Path(os.environ.get("LMCACHE_KERNEL_CACHE", Path.home() / ".cache" / "lmcache_p2p" / "kernels"))
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES)).hexdigest()[:12]
    return root / f"{digest}-torch{torch.__version__}-cuda{torch.version.cuda}-{arch}".replace("+", "_")


# A build takes ~70 s on the H200 host; torch's build lock (a bare file, no owner recorded) left
# by a build that was killed makes every later load wait on it forever.
STALE_BUILD_LOCK_S = 600.0


def clear_stale_build_lock(build_dir: Path) -> bool:
    """Remove ``build_dir``'s build lock when it is older than any build takes; True if removed.
    (Another process could replace a stale lock between the look and the removal; after ten
    minutes of a dead lock that window is microseconds, and its cost one build run twice.)"""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= STALE_BUILD_LOCK_S:
        return False  # another process may be building right now: wait for it
    logger.warning("KV kernels: removing %s, left %.0f s ago by a build that never finished (killed?)", lock, age)
    lock.unlink(missing_ok=True)
    return True


@functools.cache
def load() -> ModuleType | None:
    mode = os.environ.get("LMCACHE_KV_KERNELS", "auto").lower()
    if mode not in ("auto", "cuda", "torch"):
        raise ValueError(f"LMCACHE_KV_KERNELS={mode!r}: expected auto, cuda or torch")
    if mode == "torch":
        logger.info("KV copies: torch indexing (LMCACHE_KV_KERNELS=torch)")
        return None
    if not torch.cuda.is_available() or torch.version.cuda is None:
        if mode == "cuda":
            raise RuntimeError("LMCACHE_KV_KERNELS=cuda, but torch sees no CUDA device")
        logger.info("KV copies: torch indexing (no CUDA device)")
        return None
    arch, flags = _arch_flags(torch.cuda.get_device_capability())
    build_dir = _build_dir(arch)
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_build_lock(build_dir)
    if not any(build_dir.glob("*.so")):
        logger.info("KV kernels: building for %s into %s (first use here: about a minute)", arch, build_dir)
    t0 = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name="lmcache_p2p_kv_transfer",
            sources=[str(source) for source in SOURCES],
            build_directory=str(build_dir),
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", *flags],
            verbose=False,
        )
    except Exception as e:
        if mode == "cuda":
            raise
        names = ", ".join(source.name for source in SOURCES)
        logger.warning("KV copies: torch indexing; building %s for %s failed: %s", names, arch, e)
        return None
    logger.info(
        "KV copies: CUDA kernels (%s, %s) ready in %.1f s from %s",
        ", ".join(source.name for source in SOURCES),
        arch,
        time.perf_counter() - t0,
        build_dir,
    )
    return module
