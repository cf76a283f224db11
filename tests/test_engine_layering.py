"""Imports point one way: core (keys, config, storage, cache_engine, ...) <- lmcache_p2p.worker <-
lmcache_p2p.integration.vllm. Each check imports in a fresh interpreter, so what another test
imported cannot hide a cycle."""

from __future__ import annotations

import json
import subprocess
import sys


def modules_after_import(*modules: str) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_cache_engine_and_storage_do_not_import_the_worker():
    loaded = modules_after_import("lmcache_p2p.cache_engine", "lmcache_p2p.storage.manager")
    assert "lmcache_p2p.cache_engine" in loaded
    assert not {m for m in loaded if m == "lmcache_p2p.worker" or m.startswith("lmcache_p2p.worker.")}


def test_the_scheduler_half_of_the_connector_does_not_import_the_cache_engine():
    # It runs in vLLM's scheduler process, which has no KV: the engine (and its peers) are the ranks'.
    loaded = modules_after_import("lmcache_p2p.integration.vllm.scheduler_side")
    assert "lmcache_p2p.integration.vllm.scheduler_side" in loaded
    assert "lmcache_p2p.cache_engine" not in loaded
    assert "lmcache_p2p.worker" not in loaded


def test_the_engine_peer_contract_is_torch_free():
    # The scheduler half reads PEER_FETCH_TIMEOUT_S from it; a process without KV needs no torch.
    assert "torch" not in modules_after_import("lmcache_p2p.peer_service")
