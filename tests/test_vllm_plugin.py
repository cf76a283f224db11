"""The ``vllm.general_plugins`` entry point (issue 19): ``LMCacheConnectorV1`` without a module path.

Every check runs in a fresh Python process with vLLM itself (no mocks): the plugin changes vLLM's
connector registry, which is per process, and the decision depends on what ``import lmcache`` would
find, which a test process must not fake for the others. The entry point comes from the installed
package metadata (``pip install -e .``), exactly as vLLM finds it.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ENGINE_ENV

pytestmark = pytest.mark.engine

OURS = "lmcache_p2p.integration.vllm.connector.LMCacheConnectorV1"
BUILTIN = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector.LMCacheConnectorV1"
SWITCH = "LMC_P2P_CONNECTOR"
DECISION = "LMCacheConnectorV1 resolves to"

# Loads the plugins the way vLLM's processes do, then resolves the name the way vLLM's engine
# does (VllmConfig and create_connector both go through get_connector_class). register() is
# called again directly: vLLM documents that plugins may run more than once per process.
RESOLVE = """
import json, sys
import vllm.plugins
vllm.plugins.load_general_plugins()
vllm.plugins.load_general_plugins()
from lmcache_p2p.integration.vllm import plugin
plugin.register()
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

def resolve(**kw):
    config = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both", **kw)
    cls = KVConnectorFactory.get_connector_class(config)
    return f"{cls.__module__}.{cls.__qualname__}"

print(json.dumps({
    "by_name": resolve(),
    "by_module_path": resolve(kv_connector_module_path="lmcache_p2p.integration.vllm"),
    "lmcache_imported": "lmcache" in sys.modules,
}))
"""

# name -> (the dummy original lmcache on PYTHONPATH, LMC_P2P_CONNECTOR or None)
SCENARIOS = {
    "plain": (False, None),
    "lmcache_installed": (True, None),
    "lmcache_installed_switch_p2p": (True, "p2p"),
    "switch_lmcache": (False, "lmcache"),
    "switch_bad": (False, "bogus"),
}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (SWITCH, "VLLM_PLUGINS")}
    env.update(ENGINE_ENV, LMCACHE_LOG_LEVEL="INFO")
    if "PYTHONPATH" in extra and env.get("PYTHONPATH"):
        extra["PYTHONPATH"] += os.pathsep + env["PYTHONPATH"]
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[dict, str]]:
    """Each scenario's resolution (the JSON line) and stderr. The processes run side by side: each
    spends its time importing vLLM."""
    fake = tmp_path_factory.mktemp("fake-lmcache")
    (fake / "lmcache").mkdir()
    # Enough for importlib.util.find_spec("lmcache"); importing it fails, so a test that passes
    # also shows that neither the plugin nor the name's resolution imports the original package.
    (fake / "lmcache" / "__init__.py").write_text('raise ImportError("the dummy lmcache was imported")\n')
    procs = {}
    for name, (installed, switch) in SCENARIOS.items():
        extra = {"PYTHONPATH": str(fake)} if installed else {}
        if switch is not None:
            extra[SWITCH] = switch
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", RESOLVE],
            env=_clean_env(**extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{err[-3000:]}"
        results[name] = (json.loads(out.strip().splitlines()[-1]), err)
    return results


def _decisions(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if DECISION in line]


def test_a_the_name_resolves_to_ours_when_lmcache_is_not_installed(outcomes):
    got, err = outcomes["plain"]
    assert got["by_name"] == OURS
    (line,) = _decisions(err)  # once, although the plugin ran three times
    assert "INFO" in line and "lmcache-p2p" in line and "the original lmcache package is not installed" in line


def test_b_an_installed_lmcache_keeps_vllms_builtin_connector(outcomes):
    got, err = outcomes["lmcache_installed"]
    assert got["by_name"] == BUILTIN
    assert not got["lmcache_imported"]
    (line,) = _decisions(err)
    assert "INFO" in line and "vLLM's built-in connector" in line
    assert "the original lmcache package is installed" in line and f"{SWITCH}=p2p" in line


def test_c_the_switch_selects_ours_beside_an_installed_lmcache(outcomes):
    got, err = outcomes["lmcache_installed_switch_p2p"]
    assert got["by_name"] == OURS
    assert not got["lmcache_imported"]
    (line,) = _decisions(err)
    assert "lmcache-p2p" in line and f"{SWITCH}=p2p" in line


def test_c_the_switch_can_keep_vllms_builtin_connector(outcomes):
    got, err = outcomes["switch_lmcache"]
    assert got["by_name"] == BUILTIN
    (line,) = _decisions(err)
    assert "vLLM's built-in connector" in line and "not installed" in line


def test_d_a_bad_switch_value_is_one_error_line_and_vllms_default(outcomes):
    got, err = outcomes["switch_bad"]
    assert got["by_name"] == BUILTIN
    (line,) = _decisions(err)
    assert "ERROR" in line and f"{SWITCH}='bogus'" in line and "auto, p2p, lmcache" in line
    assert "Traceback" not in err


@pytest.mark.parametrize("scenario", ["plain", "lmcache_installed", "switch_bad"])
def test_e_kv_connector_module_path_still_selects_ours(outcomes, scenario):
    got, _ = outcomes[scenario]
    assert got["by_module_path"] == OURS


# A vLLM CPU engine in its default multiprocess mode, the engine core spawned (a fresh interpreter
# that inherits nothing from the parent's registry), with the seeds' kv-transfer-config.
ENGINE = """
import sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

llm = LLM(sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=1024, enable_prefix_caching=False,
          kv_cache_memory_bytes=64 << 20,
          kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both"))
out = llm.generate(["the cache holds keys and values"], SamplingParams(max_tokens=2, temperature=0))
print("GENERATED", len(out[0].outputs[0].token_ids), flush=True)
"""


@pytest.mark.slow
def test_f_an_engine_with_the_seeds_config_and_no_module_path_loads_our_connector(tmp_path: Path, tiny_model):
    config = tmp_path / "lmcache.yaml"
    config.write_text(yaml.safe_dump({"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.25}))
    env = _clean_env(LMCACHE_CONFIG_FILE=str(config), VLLM_WORKER_MULTIPROC_METHOD="spawn")
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, tiny_model],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the engine core with it, for the kill below
    )
    started = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the engine did not finish in {time.monotonic() - started:.0f} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    assert "GENERATED 2" in out
    assert "lmcache-p2p scheduler side" in out, out[-3000:]
    # The front process and the spawned engine core each decided for themselves.
    decisions = _decisions(out)
    assert len(decisions) >= 2 and all("lmcache-p2p" in line for line in decisions), decisions


def test_a_bare_lmcache_directory_on_the_path_is_not_the_original_lmcache(tmp_path, monkeypatch):
    # a checkout or working directory named lmcache/ is a namespace package, not LMCache
    from lmcache_p2p.integration.vllm import plugin

    (tmp_path / "lmcache").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plugin._original_lmcache_origin() is None
    (tmp_path / "lmcache" / "__init__.py").write_text("")
    importlib.invalidate_caches()
    assert plugin._original_lmcache_origin() == str(tmp_path / "lmcache" / "__init__.py")
