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
    # A process without KV needs no torch.
    assert "torch" not in modules_after_import("lmcache_p2p.peer_service")


def test_the_vocabulary_imports_nothing_of_ours():
    """Location and channel names, shared timeouts and the storage event live in a leaf: reading
    a name never loads the module that acts on it."""
    loaded = modules_after_import("lmcache_p2p.vocab")
    assert {m for m in loaded if m.startswith("lmcache_p2p")} == {"lmcache_p2p", "lmcache_p2p.vocab"}


def test_the_scheduler_half_brings_no_torch_of_its_own():
    """vLLM's scheduler process has torch because vLLM imports it, but none of our modules the
    scheduler half loads imports torch (nor the blending models, nor storage)."""
    code = (
        "import json, sys\n"
        "import lmcache_p2p.integration.vllm.scheduler_side\n"
        "ours = {n: m for n, m in sys.modules.items() if n.startswith('lmcache_p2p') and m is not None}\n"
        "print(json.dumps({n: 'torch' in vars(m) for n, m in sorted(ours.items())}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    uses_torch = json.loads(done.stdout.splitlines()[-1])
    assert "lmcache_p2p.integration.vllm.scheduler_side" in uses_torch
    assert not [name for name, imported in uses_torch.items() if imported]
    assert not {"lmcache_p2p.storage.manager", "lmcache_p2p.blend.models", "lmcache_p2p.blend.rope"} & set(uses_torch)


def test_the_controller_loads_no_engine_config_storage_or_torch():
    loaded = modules_after_import("lmcache_p2p.controller.cli", "lmcache_p2p.controller.api")
    assert "lmcache_p2p.controller.service" in loaded
    assert not {"lmcache_p2p.config", "lmcache_p2p.storage", "lmcache_p2p.cache_engine", "torch", "vllm"} & loaded
