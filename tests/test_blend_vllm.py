"""The blender through a real vLLM CPU engine's own modules: inside the engine's worker
(``LLM.apply_model``), blending the tiny model's prompt of three segments gives the KV that
transformers' modules give for the same weights and inputs, at a full blend (which is also
transformers' plain prefill) and at 15%, with the same tokens chosen to recompute."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_blending_through_the_engines_modules_equals_transformers(tiny_model):
    # (Qwen3 through vLLM's modules: test_blend_engine's Qwen3 engine, whose full blend must give
    # its cold answer.)
    done = subprocess.run(
        [sys.executable, "-m", "lmcache_p2p.testing.blend_check", tiny_model, "--ratios", "1.0,0.15"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["segments"] == 3 and 0 < report["cached_tokens"] < report["tokens"]
    for ratio in ("ratio_1", "ratio_0.15"):
        assert report[ratio]["recomputed_equal"], report
        assert report[ratio]["max_key_difference"] < 1e-4 and report[ratio]["max_value_difference"] < 1e-4, report
    assert report["ratio_1"]["recomputed"] == report["tokens"]
    uncached = report["tokens"] - report["cached_tokens"]
    assert report["ratio_0.15"]["recomputed"] == uncached + round(report["cached_tokens"] * 0.15)
    assert report["engine_full_blend_vs_hf_prefill"] < 1e-4, report
