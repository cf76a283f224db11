"""Tensor parallelism on a two-GPU host (issue 24): two vLLM engines at --tensor-parallel-size 2
(rank r of each on GPU r) share KV rank by rank through one controller, and a TP=1 engine beside
them never takes their chunks: its layout differs, so the controller offers it no holder of
theirs and the prompt is computed. Marked ``gpu``; skipped without two GPUs and vLLM's CUDA build.
The engines run the tiny model in float32 (``served_fleet.GPU_ENGINE_ARGS``)."""

from __future__ import annotations

import re

import httpx
import pytest
import torch
from protocol_client import wait_for

from lmcache_p2p.testing.processes import peer_pulls, stream_completion, wait_peer_pulls
from lmcache_p2p.testing.served_fleet import ServedFleet
from lmcache_p2p.testing.tiny_model import sample_text

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: one rank of each TP=2 engine on each"),
]

CHUNK = 256
CPU = "LocalCPUBackend"


def test_tp2_engines_share_rank_by_rank_and_a_tp1_engine_refuses_their_chunks(tmp_path, tiny_model):
    fleet = ServedFleet(
        tmp_path,
        tiny_model,
        engines=3,
        engine_tps=(2, 2, 1),
        ports_per_rank=True,
        engine_extra={"transfer_channel": "nixl", "enable_async_loading": True},
        engine_args=("--max-num-seqs", "4"),
        gpu_memory_utilization=0.2,
    )
    try:
        fleet.start(timeout=600)
        e1, e2, e3 = fleet.engine_urls
        prompt = sample_text(1200, seed=1)
        body = {"model": fleet.model, "prompt": prompt}
        tokens = httpx.post(f"{e1}/tokenize", json=body, timeout=30).json()["tokens"]
        whole = len(tokens) // CHUNK * CHUNK

        def layout_info() -> dict:
            response = httpx.post(f"{fleet.controller_url}/lookup", json={"tokens": tokens}, timeout=30)
            return response.raise_for_status().json()["layout_info"]

        cold = stream_completion(e1, fleet.model, prompt)
        wait_for(lambda: layout_info() == {"engine1": [CPU, whole]}, 30, "both of engine 1's ranks indexed")

        # Engine 2 (TP=2): each rank pulls the prompt from the same rank of engine 1.
        warm = stream_completion(e2, fleet.model, prompt)
        assert warm["text"] == cold["text"]
        pulls = wait_peer_pulls(fleet.processes["engine2"].log, 2)  # each rank logs its own pull
        pulled = [(p["rank"], int(p["tokens"]), p["peer_instance"], p["peer_rank"]) for p in pulls]
        assert sorted(pulled) == [(0, whole, "engine1", 0), (1, whole, "engine1", 1)]

        # Engine 3 (TP=1): a chunk of a TP=2 rank holds half the heads; none may be loaded here.
        alone = stream_completion(e3, fleet.model, prompt)
        assert alone["ttft_s"] is not None
        log3 = fleet.processes["engine3"].log()
        assert peer_pulls(log3) == []
        hits = [int(n) for n in re.findall(rf"Total tokens {len(tokens)}, LMCache hit tokens: (\d+)", log3)]
        assert hits == [0]
        # It stored its own computation under its own layout, beside the TP=2 engines' chunks.
        wait_for(lambda: layout_info().get("engine3") == [CPU, whole], 30, "engine 3's own chunks indexed")
    finally:
        fleet.stop()
