"""``lmcache_vllm serve MODEL ...`` (the seed's launcher), and seed 001's two-instance example
through it verbatim: ``lmcache_server`` + ``remote_server_addr`` + two OpenAI servers, where a
prompt on the first is a remote hit on the second."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENGINE_ENV
from protocol_client import wait_for

from lmcache_p2p.integration.vllm.launcher import CONNECTOR, serve_command
from lmcache_p2p.remote.lm_store import LmServerStore
from lmcache_p2p.remote.url import parse_remote_url
from lmcache_p2p.testing.ports import free_ports

LAUNCHER = str(Path(sys.executable).with_name("lmcache_vllm"))


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_serve_adds_our_connector_and_passes_every_other_argument_through():
    command = serve_command("/models/tiny", ["--port", "8000", "--gpu-memory-utilization", "0.8"])
    after_model = command[command.index("/models/tiny") + 1 :]
    assert after_model[:4] == ["--port", "8000", "--gpu-memory-utilization", "0.8"]
    assert json.loads(_option(command, "--kv-transfer-config")) == CONNECTOR
    assert command.count("--kv-transfer-config") == 1


def test_a_kv_transfer_config_the_user_gives_is_kept(caplog):
    mine = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_producer"}'
    assert _option(serve_command("m", ["--kv-transfer-config", mine]), "--kv-transfer-config") == mine
    other = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
    with caplog.at_level("WARNING"):
        command = serve_command("m", [f"--kv-transfer-config={other}"])
    assert command.count(f"--kv-transfer-config={other}") == 1 and "lmcache-p2p stays off" in caplog.text


@pytest.mark.parametrize("argv", [["run", "m"], ["serve"], ["serve", "--port", "1"]])
def test_anything_but_serve_model_is_a_usage_error(argv):
    done = subprocess.run([LAUNCHER, *argv], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "expected `serve MODEL ...`" in done.stderr and "usage:" in done.stderr


@pytest.mark.engine
@pytest.mark.slow
def test_seed_001_two_instances_share_kv_through_lmcache_server(tmp_path, tiny_model, lm_server):
    from lmcache_p2p.testing.processes import CPU_ENGINE_ARGS, ServedProcess, stream_completion
    from lmcache_p2p.testing.tiny_model import sample_text

    # The seed's cache_config.yaml, as written (plus the chunk size and a small pool for 2 cores).
    config = tmp_path / "cache_config.yaml"
    config.write_text(f'remote_server_addr: "127.0.0.1:{lm_server.port}"\nchunk_size: 256\nmax_local_cpu_size: 0.25\n')
    engines, urls = [], []
    try:
        for i, port in enumerate(free_ports(2), start=1):
            engines.append(
                ServedProcess(
                    f"instance{i}",
                    [LAUNCHER, "serve", tiny_model, "--port", str(port), *CPU_ENGINE_ARGS],
                    tmp_path / f"instance{i}.log",
                    {**ENGINE_ENV, "LMCACHE_CONFIG_FILE": str(config)},
                ).start()
            )
            urls.append(f"http://127.0.0.1:{port}")
        for engine, url in zip(engines, urls, strict=True):
            engine.wait_http(f"{url}/health", timeout=300)
        prompt = sample_text(700, seed=5)
        first = stream_completion(urls[0], tiny_model, prompt)
        # the first instance's chunks reach the server behind its store path
        store = LmServerStore(parse_remote_url(lm_server.url), 2.0)
        try:
            wait_for(lambda: store.health()["chunks"] >= 2, timeout=20, what="instance 1's chunks in lmcache_server")
        finally:
            store.close()
        second = stream_completion(urls[1], tiny_model, prompt)
        log = engines[1].log()
        assert second["text"] == first["text"]
        assert f"remote tier lm://127.0.0.1:{lm_server.port}: fetched 2 of 2 chunk(s) (512 tokens" in log, log[-3000:]
        assert "lmcache_vllm: " in engines[0].log()  # the launcher said what it runs
    finally:
        for engine in engines:
            engine.terminate()
        for engine in engines:
            engine.stop()


@pytest.mark.parametrize(
    "given",
    [
        ["--kv_transfer_config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'],
        ['--kv_transfer_config={"kv_connector":"NixlConnector","kv_role":"kv_both"}'],
        ["--kv-transfer-config.kv_role", "kv_producer"],
        ["--config", "vllm.yaml"],
    ],
)
def test_every_spelling_of_a_users_own_kv_transfer_config_is_left_alone(given):
    command = serve_command("m", given)
    assert command[command.index("m") + 1 :] == given, "the launcher added or changed a connector config"
