"""An offline vLLM engine (``vllm.LLM``) with our connector, driven by JSON lines.

The vLLM end-to-end tests and ``benchmarks/bench_vllm_cpu.py`` run it as a process:

    python -m lmcache_p2p.testing.offline_driver MODEL_DIR [--no-connector]

The engine runs in this process (scheduler and worker alike), so the connector's cache engine is
reachable through vLLM's ``get_kv_transfer_group()`` for ``status`` and ``corrupt``. The LMCache configuration
comes from ``LMCACHE_CONFIG_FILE`` / ``LMCACHE_*`` as for any engine.

One JSON request per line on stdin, one answer per line on stdout (everything else goes to
stderr). Operations:

* ``{"op": "generate", "prompt_ids": [...], "max_tokens": 16}`` -> ``token_ids``, ``ttft_s``
  (arrival to first token) and ``total_s``; optionally ``"cache_salt"`` (vLLM's, in the prompt),
  ``"lora": {"name", "id", "path"}`` (a LoRARequest; needs ``--enable-lora``) and ``"images":
  [seed, ...]`` (random RGB images of ``--image-size`` pixels a side, one per seed, for the
  prompt's image tokens in order; needs ``--images N``);
* ``{"op": "corrupt"}`` negates every value of every chunk held in the CPU tier (a wrong but finite
  KV, to prove a hit really feeds the model) -> ``chunks``;
* ``{"op": "fail_next_load"}`` makes the cache engine's next load raise (a dead peer's or a
  failed check's effect on a promised hit: vLLM must recompute, not fail the request);
* ``{"op": "generate_batch", "prompts": [[...], ...], "max_tokens": 16}`` -> ``outputs`` (each
  prompt's ``token_ids``) and ``preemptions`` (vLLM's count during the batch): every prompt at
  once, as an engine under load runs them;
* ``{"op": "engine_info"}`` -> the vLLM release (``vllm``), its model runner class
  (``model_runner``), what its scheduler took from our connector (``requires_kv_delivery``),
  whether it schedules asynchronously (``async_scheduling``), its KV cache's ``num_gpu_blocks``
  and ``block_size``, and how many preemptions so far
  dropped a request's output in flight or kept it (``preemptions_dropping_output``,
  ``preemptions_keeping_output``);
* ``{"op": "status"}`` -> the cache engine's status (tiers, counters, worker);
* ``{"op": "metrics"}`` -> ``text``: vLLM's Prometheus exposition in this process (its ``/metrics``
  page, with the connector's ``lmcache:`` series);
* ``{"op": "flush"}`` waits for disk writes and the controller reports;
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from lmcache_p2p.testing import jsonlines


def command(model: str, *args: str, connector: bool = True) -> list[str]:
    """The command line that runs this driver on ``model`` (tests, benchmarks)."""
    module = "lmcache_p2p.testing.offline_driver"
    return [sys.executable, "-m", module, model, *args, *(() if connector else ("--no-connector",))]


def _engine():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    engine = getattr(get_kv_transfer_group(), "cache_engine", None) if has_kv_transfer_group() else None
    if engine is None:
        raise RuntimeError("no lmcache-p2p cache engine in this process (started with --no-connector?)")
    return engine


def _corrupt(engine) -> int:
    import torch

    dtype = getattr(torch, engine.layout.dtype)
    hashes = engine.storage.held_hashes("LocalCPUBackend")
    for chunk_hash in hashes.tolist():
        chunk = engine.storage.pin(int(chunk_hash))
        if chunk is not None:
            with chunk:
                chunk.data.view(dtype).neg_()
    return len(hashes)


def _fail_next_load(engine) -> None:
    # Every load is planned first, in the step, layer by layer and beside the steps alike.
    real = engine.plan_load

    def failing(*args, **kwargs):
        engine.plan_load = real
        raise RuntimeError("injected load failure (offline driver: fail_next_load)")

    engine.plan_load = failing


def _generate(llm, request: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=int(request.get("max_tokens", 16)), ignore_eos=True)
    prompt: dict = {"prompt_token_ids": list(request["prompt_ids"])}
    if request.get("cache_salt"):
        prompt["cache_salt"] = request["cache_salt"]
    if request.get("images"):
        prompt["multi_modal_data"] = {
            "image": [_image(seed, request.get("image_size", 56)) for seed in request["images"]]
        }
    lora = request.get("lora")
    extra = {}
    if lora:
        from vllm.lora.request import LoRARequest

        extra["lora_request"] = LoRARequest(lora["name"], int(lora["id"]), lora["path"])
    t0 = time.perf_counter()
    output = llm.generate([prompt], params, use_tqdm=False, **extra)[0]
    total = time.perf_counter() - t0
    answer = {"token_ids": list(output.outputs[0].token_ids), "total_s": total}
    metrics = getattr(output, "metrics", None)
    first = getattr(metrics, "first_token_latency", None) if metrics is not None else None
    answer["ttft_s"] = float(first) if first else None
    return answer


def _image(seed: int, size: int):
    """A random RGB image, the same for the same seed."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8))


def _preemptions(llm) -> int:
    for metric in llm.get_metrics():
        if metric.name == "vllm:num_preemptions":
            return int(metric.value)
    return 0


def _generate_batch(llm, request: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=int(request.get("max_tokens", 16)), ignore_eos=True)
    before = _preemptions(llm)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in request["prompts"]], params, use_tqdm=False)
    return {"outputs": [list(o.outputs[0].token_ids) for o in outputs], "preemptions": _preemptions(llm) - before}


def _engine_core(llm):
    return llm.llm_engine.engine_core.engine_core  # in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0


# How vLLM's scheduler preempted (vLLM >= 0.27 drops a preempted request's output in flight where
# its connector requires KV delivery); counted by a wrapper around Scheduler._preempt_request.
_PREEMPT_CALLS = {"dropping_output": 0, "keeping_output": 0}


def _watch_preemptions(llm) -> None:
    scheduler = _engine_core(llm).scheduler
    preempt = scheduler._preempt_request

    def counted(request, timestamp, *args, **kwargs):
        dropping = bool(kwargs.get("drop_stale_output", args[0] if args else False))
        _PREEMPT_CALLS["dropping_output" if dropping else "keeping_output"] += 1
        return preempt(request, timestamp, *args, **kwargs)

    scheduler._preempt_request = counted


def _engine_info(llm) -> dict:
    from lmcache_p2p.integration.vllm.compat import installed_release

    core = _engine_core(llm)
    worker = core.model_executor.driver_worker
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    return {
        "vllm": str(installed_release()),
        "model_runner": f"{type(runner).__module__}.{type(runner).__name__}",
        "requires_kv_delivery": getattr(core.scheduler, "requires_kv_delivery", None),
        "async_scheduling": bool(core.vllm_config.scheduler_config.async_scheduling),
        # what the cache came out as (a test that means to preempt says so when it did not)
        "num_gpu_blocks": core.vllm_config.cache_config.num_gpu_blocks,
        "block_size": core.vllm_config.cache_config.block_size,
        **{f"preemptions_{k}": v for k, v in _PREEMPT_CALLS.items()},
    }


def handler(llm):
    def handle(request: dict) -> dict:
        op = request["op"]
        if op == "generate":
            return _generate(llm, request)
        if op == "generate_batch":
            return _generate_batch(llm, request)
        if op == "engine_info":
            return _engine_info(llm)
        if op == "corrupt":
            return {"chunks": _corrupt(_engine())}
        if op == "fail_next_load":
            _fail_next_load(_engine())
            return {}
        if op == "status":
            return _engine().status()
        if op == "flush":
            _engine().flush()
            return {}
        if op == "metrics":  # vLLM's Prometheus registry in this process, ours included
            from prometheus_client import REGISTRY, generate_latest

            return {"text": generate_latest(REGISTRY).decode()}
        raise ValueError(f"unknown op {op!r}")

    return handle


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lmcache_p2p.testing.offline_driver", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("model")
    parser.add_argument("--no-connector", action="store_true", help="plain vLLM, for baselines")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, help="vLLM's KV cache blocks (a small cache preempts)")
    parser.add_argument(
        "--block-size", type=int, help="tokens a KV cache block holds (vLLM's default: 16 before 0.34, 64 from 0.34)"
    )
    parser.add_argument("--kv-role", default="kv_both")
    parser.add_argument("--dtype", default="float32", help="the model's dtype in vLLM (on a GPU: bfloat16)")
    parser.add_argument(
        "--max-num-inflight-kv-loads", type=int, help="vLLM >= 0.34's cap on asynchronous KV loads in flight"
    )
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (generate's lora)")
    parser.add_argument("--max-lora-rank", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--images", type=int, default=0, help="a multimodal model: at most this many images a prompt")
    args = parser.parse_args(argv)

    answers = jsonlines.claim_stdout()
    # One process: the scheduler's and the worker's connector halves live here with the engine.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_transfer = None
    if not args.no_connector:
        kv_transfer = KVTransferConfig(
            kv_connector="LMCacheConnectorV1",
            kv_connector_module_path="lmcache_p2p.integration.vllm",
            kv_role=args.kv_role,
        )
    # only for a multimodal model (a text model refuses the limit)
    mm_limits: dict[str, Any] = {"limit_mm_per_prompt": {"image": args.images}} if args.images else {}
    llm = LLM(
        args.model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
        num_gpu_blocks_override=args.num_blocks,
        # only when asked: a test that sizes its cache in blocks names the block it means
        **({"block_size": args.block_size} if args.block_size else {}),
        distributed_executor_backend="uni",
        kv_transfer_config=kv_transfer,
        seed=0,
        disable_log_stats=False,
        # only when asked: releases before 0.34 have no such argument
        **({"max_num_inflight_kv_loads": args.max_num_inflight_kv_loads} if args.max_num_inflight_kv_loads else {}),
        **(
            {"enable_lora": True, "max_lora_rank": args.max_lora_rank, "max_loras": args.max_loras}
            if args.enable_lora
            else {}
        ),
        **mm_limits,
    )
    _watch_preemptions(llm)
    jsonlines.answer(answers, {"ok": True, "ready": True})
    try:
        jsonlines.serve(handler(llm), sys.stdin, answers)
    finally:
        del llm


if __name__ == "__main__":
    main()
