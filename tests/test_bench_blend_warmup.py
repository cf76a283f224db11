"""benchmarks/bench_blend.py --engine warms each engine up with one short prompt before the measured
ones: its token ids must be valid for whatever model the benchmark runs, including the random-weight
models built with a locally trained tokenizer of a few hundred tokens (vLLM refuses an id past the
vocabulary, and the benchmark then crashes on its first request)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from transformers import AutoTokenizer

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_blend.py"


def bench_blend():
    spec = importlib.util.spec_from_file_location("bench_blend", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_warm_up_prompt_is_inside_a_small_locally_trained_vocabulary_and_under_a_chunk(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = bench_blend().warmup_ids(tokenizer)
    assert len(ids) == 64  # under a 256-token chunk: never stored, never blended
    assert all(0 <= i < len(tokenizer) for i in ids), (len(tokenizer), sorted(set(ids))[-5:])
    assert tokenizer.decode(ids).startswith("Before its first request")
