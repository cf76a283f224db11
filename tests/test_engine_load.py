"""The worker's report of its engine's load (worker/engine_load.py): the queue read from the
engine's /metrics at ``serve_url``, carried by heartbeats to the controller, where POST /route
shows it. A real stand-in instance process and a real controller; the engine's API server is a
real HTTP server publishing vLLM's gauges through prometheus_client, as vLLM does."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from instances import InstanceProcess, instance_config
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from protocol_client import ControllerProcess, wait_for

from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.worker.engine_load import parse_engine_metrics


def vllm_metrics(engines: dict[str, tuple[int, int, float]]) -> str:
    """A /metrics page with vLLM's queue gauges for each engine index: (running, waiting, kv usage)."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "running", labels, registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "kv usage", labels, registry=registry)
    for engine, (r, w, u) in engines.items():
        running.labels("tiny", engine).set(r)
        waiting.labels("tiny", engine).set(w)
        usage.labels("tiny", engine).set(u)
    return generate_latest(registry).decode()


def test_the_queue_is_summed_over_engines_and_kv_usage_is_the_fullest_engines():
    reading = parse_engine_metrics(vllm_metrics({"0": (3, 1, 0.25), "1": (2, 4, 0.75)}))
    assert reading is not None
    assert (reading.running, reading.waiting, reading.kv_usage) == (5, 5, 0.75)
    assert parse_engine_metrics("# a page with no vLLM gauges\nup 1\n") is None


@pytest.mark.parametrize(
    "url, why",
    [
        ("127.0.0.1:8000", "expected http://host:port"),
        ("http://{hostname}:8000", "only {host} expands"),
        ("ftp://h:1", "expected http://host:port"),
    ],
)
def test_a_bad_serve_url_names_the_key(url, why):
    with pytest.raises(ConfigError, match=f"serve_url.*{why}"):
        LMCacheConfig.from_dict({"serve_url": url}).validate()


class MetricsServer:
    """The engine's API server, as far as the worker reads it: GET /metrics."""

    def __init__(self):
        self.page = vllm_metrics({"0": (0, 0, 0.0)})
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 -- http.server's name
                body = server.page.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def stop(self):
        self.http.shutdown()
        self.http.server_close()


def test_heartbeats_carry_the_engines_queue_to_route_and_a_silent_server_stops_counting(tmp_path):
    controller = ControllerProcess("--log-level", "warning").start()
    metrics = MetricsServer()
    instance = None
    try:
        config = instance_config(
            "served",
            controller,
            serve_url=f"http://{{host}}:{metrics.port}",  # {host}: p2p_host, 127.0.0.1 here
            lmcache_worker_heartbeat_time=0.3,
        )
        instance = InstanceProcess(config, tmp_path).start()

        def served_entry():
            answer = controller.api("/route", {"tokens": list(range(64))})
            return next((r for r in answer["ranked"] if r["instance_id"] == "served"), None)

        metrics.page = vllm_metrics({"0": (3, 2, 0.5)})
        seen = wait_for(
            lambda: (e := served_entry()) and e["load"]["reported"] and e["load"]["running"] == 3 and e,
            10,
            "the engine's queue at /route",
        )
        assert seen["serve_url"] == f"http://127.0.0.1:{metrics.port}"
        assert (seen["load"]["waiting"], seen["load"]["kv_usage"]) == (2, 0.5)
        busy_ms = seen["load_ms"]
        assert busy_ms > 0, seen

        metrics.page = vllm_metrics({"0": (0, 0, 0.0)})  # the queue drained
        idle = wait_for(lambda: (e := served_entry()) and e["load"]["running"] == 0 and e, 10, "the drained queue")
        assert idle["load_ms"] < busy_ms

        # A server that stops answering: its last numbers age out instead of standing forever.
        metrics.page = vllm_metrics({"0": (7, 7, 0.9)})
        wait_for(lambda: served_entry()["load"]["running"] == 7, 10, "the busy queue")
        metrics.stop()
        wait_for(lambda: not served_entry()["load"]["reported"], 15, "the stale queue to be dropped")
        assert "cannot read the engine's load from" in instance.log()
        status = instance.request("status")
        assert status["engine_load"]["scrape_failures"] >= 1, status
    finally:
        if instance is not None:
            instance.stop()
        controller.stop()
