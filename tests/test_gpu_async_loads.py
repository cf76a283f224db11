"""Loads beside the steps (``async_kv_loads``) in vLLM's CUDA build: a peer hit is copied into
the request's blocks on the load stream while vLLM holds the request out of its steps, and it
computes from them once the copy is reported done. Marked ``gpu``; the CPU build's protocol is
tested in test_vllm_cpu.py and test_connector_units.py. The default, "auto", loads a hit just
pulled in the step (test_connector_units.py); here every load goes beside the steps."""

from __future__ import annotations

import re

import pytest
import torch

from lmcache_p2p.testing.processes import peer_pulls, stream_completion
from lmcache_p2p.testing.served_fleet import ServedFleet
from lmcache_p2p.testing.tiny_model import sample_text

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the H200 device)"),
]

CHUNK = 256


def test_a_peer_hit_loaded_beside_the_steps_on_a_gpu_gives_the_cold_output(tmp_path, tiny_model):
    fleet = ServedFleet(
        tmp_path,
        tiny_model,
        engines=2,
        engine_extra={"async_kv_loads": True, "enable_async_loading": True},
        engine_args=("--max-num-seqs", "4"),
        gpu_memory_utilization=0.2,
    )
    try:
        fleet.start(timeout=600)
        e1, e2 = fleet.engine_urls
        prompt = sample_text(1200, seed=3)
        cold = stream_completion(e1, fleet.model, prompt)
        warm = stream_completion(e2, fleet.model, prompt)
        assert warm["text"] == cold["text"]
        log2 = fleet.processes["engine2"].log()
        (pull,) = peer_pulls(log2)
        tokens = int(pull["tokens"])
        assert tokens >= 4 * CHUNK
        assert f"loading {tokens} tokens beside the steps" in log2
        # Queued on the load stream and reported done by get_finished (not copied in the step),
        # from the CPU pool through the ring of GPU pages (load_staging_mb) by the copy engine.
        assert re.search(r"loads beside the steps come from host memory through \d+ chunk pages", log2), log2[-3000:]
        # (in pieces where its pull landed it in several batches, each copied while the rest came)
        how = r"\(beside the steps, through the copy engine(?:, in \d+ pieces as its pull landed them)?\)"
        assert re.search(rf"Retrieved {tokens} out of total \d+ tokens\. .*{how}", log2), log2[-3000:]
    finally:
        fleet.stop()
