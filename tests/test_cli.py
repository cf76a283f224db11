"""The installed console scripts and the package layout a user relies on."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
BIN = Path(sys.executable).parent


def run(*args, env=None, stdin=None):
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        input=stdin,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_console_scripts_are_installed():
    for name in ("lmcache_controller", "lmcache-p2p"):
        assert shutil.which(name, path=str(BIN)), f"{name} missing from {BIN}"
    assert "--monitor-ports" in run("lmcache_controller", "--help").stdout


def test_config_command_shows_values_and_their_sources():
    out = run(
        "lmcache-p2p",
        "config",
        env={"LMCACHE_CONFIG_FILE": str(CONFIGS / "example2.yaml"), "LMCACHE_CHUNK_SIZE": "512"},
    )
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["chunk_size"] == {"value": 512, "from": "env LMCACHE_CHUNK_SIZE"}
    assert shown["lmcache_instance_id"]["value"] == "lmcache_instance_2"


def test_config_command_reports_one_clear_line_on_error():
    out = run("lmcache-p2p", "config", "--file", str(CONFIGS / "example1.yaml"), "--tp-size", "2")
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("config error: lmcache_worker_ports=[8500]") and "Traceback" not in out.stderr


def test_hash_command_matches_the_library():
    from lmcache_p2p.keys import chunk_hashes

    tokens = list(range(600))
    out = run("lmcache-p2p", "hash", "--chunk-size", "256", stdin=json.dumps(tokens))
    assert [int(s["hash"], 16) for s in json.loads(out.stdout)] == chunk_hashes(tokens, 256)


def test_controller_package_never_imports_torch_or_vllm():
    code = (
        "import sys, lmcache_p2p.controller.cli, lmcache_p2p.keys, lmcache_p2p.config; "
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
