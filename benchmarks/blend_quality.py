"""Blending's quality on the CacheBlend authors' own evaluation inputs (issue 43, item 4): MuSiQue
and 2WikiMQA subsets scored by token F1, SAMSum by Rouge-L, for full prefill, naive reuse and
blending at 5/15/30%, on a genuinely pretrained model through transformers.

The inputs are the ``inputs/`` folder of the authors' public repository (``musique_s.json``,
``wikimqa_s.json``, ``samsum.json``): this benchmark takes its path and commits none of it.

    pip install 'lmcache-p2p[bench]' rouge-score    # gguf + accelerate (SmolLM2), rouge-score (SAMSum)
    python -m lmcache_p2p.testing.pretrained /work/models    # prints MODEL_DIR (SmolLM2-135M-Instruct)
    .venv/bin/python benchmarks/blend_quality.py --inputs DIR --model MODEL_DIR --dataset musique \\
        [--limit 50] [--device cpu|cuda] [--methods full,naive,blend5,blend15,blend30]

Each example is built as the authors' example scripts build it (``example/blend_{musique,
wikimqa,samsum}.py`` and ``example/utils.py`` there), in the model's own chat format where theirs
used Mistral's ``[INST] ... [/INST]``. Segments, in order:

* the prefix: the chat template's opening up to the user's text, then the task's instruction
  (QA: "... Passages:\\n"; SAMSum: "Summarize the dialogue ... examples.\\n\\n");
* one per context: QA ``f"{title}\\n\\n{text}\\n\\n"``; SAMSum each few-shot example's text (when
  they exceed ``--max-ctx`` tokens, the middle one is dropped until they fit, as theirs does);
* the suffix: QA ``f"{query_prompt}{question}\\nAnswer:"`` (the question with a '?' and a lower-
  case first letter); SAMSum ``"\\n\\n" + dialogue``; then the template's end of the user turn and
  the assistant's opening. This is the new text: never cached, always recomputed.

Every segment is tokenized alone and the prompt is their concatenation (the same ids for every
method). Each segment but the suffix is "cached" as a store holds it: its KV computed alone at
positions from 0 (``--sink``: after the model's BOS token, dropped afterwards, as the authors'
scripts did), then its keys re-rotated to its place (lmcache_p2p.blend.rope). Methods, each the
blender (lmcache_p2p.blend.blender.blend) over the prompt but its last token, but ``full``:

* ``full``: transformers' own prefill of the prompt (the reference; ``blend100``, the blender at
  ratio 1.0, equals it up to rounding, tests/test_blend_core.py, but its boolean-mask attention
  over the whole prompt is several times slower on a CPU);
* ``naive``: ratio 0.0 at check layer 0 (the cached KV as is; only the suffix computed);
* ``blendX``: ratio X/100 at check layer ``--check-layer`` (1).

The answer is greedy-decoded from that KV by transformers (the last prompt token first), up to
``--new-tokens`` (QA 32, SAMSum 128, as theirs), stopping at the end of turn or the first line
break after some text (only the first line is scored). Scoring as theirs: QA, the first line
(a leading Yes/No reduced to the word) against each gold answer (MuSiQue: ``answers``, strings;
2WikiMQA: the first alias of each entry of ``answers``), lowercased, punctuation and articles
removed, as the model's tokenizer's tokens, token F1, the best over answers; SAMSum, Rouge-L F of
the first line (rouge_score, Porter stemmer), the best over ``answers``.

Prints one JSON object: per method the mean score and count, the mean time of the blend plus
the first token (a TTFT on this host, transformers in eager PyTorch: relative costs, not an
engine's), and the share of examples whose answer equals ``full``'s.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import string
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lmcache_p2p.blend.blender import BlendResult, blend
from lmcache_p2p.blend.models import HFDecoder, cache_keyword, hf_prefill_kv
from lmcache_p2p.blend.rope import rotate_keys

FILES = {"musique": "musique_s.json", "wikimqa": "wikimqa_s.json", "samsum": "samsum.json"}
# The instructions of the authors' scripts, word for word.
PREFIX = {
    "musique": "You will be asked a question after reading several passages. Please directly answer the question "
    "based on the given passages. Do NOT repeat the question. The answer should be within 5 words..\nPassages:\n",
    "wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n",
}
QUERY = {
    "musique": "\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. The "
    "answer should be within 5 words. \nQuestion:",
    "wikimqa": "\n\nAnswer the question based on the given passages. Answer the question within 5 words. Do NOT "
    "repeat the question or output any other words. Question: ",
}
NEW_TOKENS = {"musique": 32, "wikimqa": 32, "samsum": 128}
MARKER = "\x00USER\x00"


# -- prompts ---------------------------------------------------------------------------------------


def chat_frame(tokenizer) -> tuple[str, str]:
    """The model's chat template around one user message: (text before it, text after it up to the
    assistant's opening); plain ("", "") for a model without one."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": MARKER}], tokenize=False, add_generation_prompt=True
    )
    head, tail = text.split(MARKER)
    return head, tail


def normalize_question(question: str) -> str:
    if not question.endswith("?"):
        question += "?"
    return question[0].lower() + question[1:]


def segments_of(dataset: str, example: dict, frame: tuple[str, str]) -> tuple[str, list[str], str]:
    """(prefix, contexts, suffix) texts of one example."""
    head, tail = frame
    if dataset == "samsum":
        contexts = [ctx["text"] for ctx in example["ctxs"]]
        suffix = "\n\n" + example["question"]
    else:
        contexts = [f"{ctx['title']}\n\n{ctx['text']}\n\n" for ctx in example["ctxs"]]
        suffix = f"{QUERY[dataset]}{normalize_question(example['question'])}\nAnswer:"
    return head + PREFIX[dataset], contexts, suffix + tail


def gold_answers(dataset: str, example: dict) -> list[str]:
    if dataset == "wikimqa":  # each entry a list of aliases; the authors score the first
        return [a[0] if isinstance(a, list) else a for a in example["answers"]]
    return list(example["answers"])


# -- scoring ---------------------------------------------------------------------------------------


def first_line(text: str) -> str:
    return text.lstrip("\n").split("\n")[0]


def parse_answer(text: str) -> str:
    s = first_line(text)
    words = s.split()
    if s.startswith(("Yes", "yes")):
        return "Yes"
    if words and words[0].startswith(("No", "no")):
        return "No"
    return s


def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def token_f1(predicted: str, gold: str, encode) -> float:
    pred = encode(normalize_answer(parse_answer(predicted)))
    want = encode(normalize_answer(gold))
    if not pred or not want:
        return float(pred == want)
    same = sum((collections.Counter(pred) & collections.Counter(want)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(want)
    return 2 * precision * recall / (precision + recall)


class RougeL:
    def __init__(self):
        from rouge_score import rouge_scorer

        self.scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)

    def __call__(self, predicted: str, gold: str) -> float:
        return self.scorer.score(gold, first_line(predicted))["rougeL"].fmeasure


# -- KV --------------------------------------------------------------------------------------------


def cached_prompt(
    model, adapter: HFDecoder, pieces: list[list[int]], sink: int | None, device: str
) -> tuple[torch.Tensor, list, list, torch.Tensor, float]:
    """The prompt's ids (pieces concatenated), every piece but the last computed alone and moved to
    its place, the last zeros and not cached; and the seconds that took."""
    started = time.perf_counter()
    ids = torch.tensor([t for piece in pieces for t in piece], device=device)
    layers = model.config.num_hidden_layers
    shape = (len(ids), adapter.num_kv_heads, adapter.head_dim)
    dtype = model.dtype
    keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    cached = torch.zeros(len(ids), dtype=torch.bool, device=device)
    start = 0
    for piece in pieces[:-1]:
        lead = [] if sink is None else [sink]
        k, v = hf_prefill_kv(model.model, torch.tensor(lead + piece, device=device))  # no LM head
        end = start + len(piece)
        for layer in range(layers):
            # Computed at positions len(lead).., placed at start..: one rotation by the difference.
            keys[layer][start:end] = rotate_keys(k[layer][len(lead) :], start - len(lead), adapter.inv_freq)
            values[layer][start:end] = v[layer][len(lead) :]
        cached[start:end] = True
        start = end
    return ids, keys, values, cached, time.perf_counter() - started


@torch.inference_mode()
def decode(
    model, keys: list, values: list, last_token: int, new_tokens: int, stop: set[int], newline
) -> tuple[list[int], float]:
    """Greedy tokens after a prompt whose KV (every token but the last) is given, the last token
    fed first; stops at a ``stop`` id or at a line break after some text. Returns the tokens and
    the seconds to the first one."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous(), layer)
    keyword = cache_keyword(model)
    device = keys[0].device
    position, token, out = keys[0].shape[0], last_token, []
    started, first = time.perf_counter(), 0.0
    for step in range(new_tokens):
        logits = model(
            input_ids=torch.tensor([[token]], device=device),
            position_ids=torch.tensor([[position]], device=device),
            **{keyword: cache},
        ).logits
        token = int(logits[0, -1].argmax())
        if step == 0:
            first = time.perf_counter() - started
        if token in stop:
            break
        out.append(token)
        position += 1
        if newline(out):
            break
    return out, first


def parse_methods(text: str) -> list[tuple[str, float, int | None]]:
    """(name, ratio, check layer or None for --check-layer) per method name."""
    methods = []
    for name in [m.strip() for m in text.split(",") if m.strip()]:
        if name == "full":
            methods.append((name, 1.0, None))
        elif name == "naive":
            methods.append((name, 0.0, 0))
        elif re.fullmatch(r"blend\d+(\.\d+)?", name):
            methods.append((name, float(name[5:]) / 100, None))
        else:
            raise SystemExit(f"unknown method {name!r}: full, naive or blendX (X percent recomputed)")
    return methods


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", required=True, help="a copy of the authors' inputs/ folder")
    parser.add_argument("--model", required=True, help="a transformers Llama checkpoint directory")
    parser.add_argument("--dataset", choices=sorted(FILES), required=True)
    parser.add_argument("--limit", type=int, default=50, help="N examples")
    parser.add_argument("--offset", type=int, default=0, help="from this one on (to split a run)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--methods", default="full,naive,blend5,blend15,blend30")
    parser.add_argument("--check-layer", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: QA 32, SAMSum 128 (as theirs)")
    parser.add_argument("--max-ctx", type=int, default=3400, help="SAMSum: the few-shot examples' token budget")
    parser.add_argument("--sink", action="store_true", help="compute each segment after the BOS token")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--verbose", action="store_true", help="print each answer to stderr")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(args.inputs) / FILES[args.dataset]
    examples = json.loads(path.read_text())[args.offset : args.offset + args.limit]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    adapter = HFDecoder(model)
    methods = parse_methods(args.methods)
    new_tokens = args.new_tokens or NEW_TOKENS[args.dataset]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    frame = chat_frame(tokenizer)
    stop = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if i is not None}
    stop.discard(tokenizer.unk_token_id)
    newline = lambda out: "\n" in tokenizer.decode(out).lstrip("\n")  # noqa: E731
    sink = tokenizer.bos_token_id if args.sink else None
    if args.sink and sink is None:
        raise SystemExit("--sink: this tokenizer has no BOS token")
    rouge = RougeL() if args.dataset == "samsum" else None
    limit_positions = getattr(model.config, "max_position_embeddings", None)

    scores: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    times: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    same_as_full: dict[str, list[bool]] = {name: [] for name, _, _ in methods}
    recomputed: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    segment_seconds, prompt_tokens, skipped = [], [], 0
    with torch.inference_mode():  # warm-up: the first forwards pay for allocations and kernels' set-up
        warm = torch.tensor(encode(PREFIX[args.dataset]), device=args.device)
        hf_prefill_kv(model.model, warm)
        model(input_ids=warm[None])
    for index, example in enumerate(examples, start=args.offset):
        prefix, contexts, suffix = segments_of(args.dataset, example, frame)
        context_ids = [encode(c) for c in contexts]
        if args.dataset == "samsum":  # the authors' rule: drop the middle example until they fit
            while context_ids and sum(map(len, context_ids)) > args.max_ctx:
                del context_ids[len(context_ids) // 2]
        pieces = [encode(prefix), *context_ids, encode(suffix)]
        total = sum(map(len, pieces))
        if not context_ids or (limit_positions and total + new_tokens > limit_positions):
            skipped += 1
            continue
        ids, keys, values, cached, seconds = cached_prompt(model, adapter, pieces, sink, args.device)
        segment_seconds.append(seconds)
        prompt_tokens.append(total)
        n = len(ids) - 1  # the blend covers every token but the last; decoding feeds the last
        answers: dict[str, str] = {}
        for name, ratio, check in methods:
            started = time.perf_counter()
            if name == "full":  # transformers' own prefill (blend100: the same through the blender)
                full_keys, full_values = hf_prefill_kv(model.model, ids[:n])
                result = BlendResult(full_keys, full_values, torch.arange(n), None)
            else:
                result = blend(
                    adapter,
                    ids[:n],
                    [k[:n] for k in keys],
                    [v[:n] for v in values],
                    cached[:n],
                    ratio=ratio,
                    check_layer=args.check_layer if check is None else check,
                )
            if args.device == "cuda":
                torch.cuda.synchronize()
            blended = time.perf_counter() - started
            out, first = decode(model, result.keys, result.values, int(ids[n]), new_tokens, stop, newline)
            times[name].append(blended + first)
            text = tokenizer.decode(out, skip_special_tokens=True)
            answers[name] = first_line(text)
            gold = gold_answers(args.dataset, example)
            if rouge is not None:
                score = max(rouge(text, g) for g in gold)
            else:
                score = max(token_f1(text, g, encode) for g in gold)
            scores[name].append(score)
            recomputed[name].append(len(result.recomputed) / n)
            if args.verbose:
                print(
                    f"[{index}] {name} ({times[name][-1]:.1f} s): {answers[name]!r} score {score:.3f} gold {gold[:3]}",
                    file=sys.stderr,
                    flush=True,
                )
        for name in answers:
            if "full" in answers:
                same_as_full[name].append(answers[name] == answers["full"])

    def mean(xs: list[float]) -> float | None:
        return round(statistics.fmean(xs), 4) if xs else None

    report: dict[str, Any] = {
        "dataset": args.dataset,
        "metric": "rougeL" if rouge is not None else "f1",
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "offset": args.offset,
        "examples": len(prompt_tokens),
        "skipped": skipped,
        "prompt_tokens_mean": mean(prompt_tokens),
        "segment_kv_s_mean": mean(segment_seconds),
        "sink": args.sink,
        "methods": {
            name: {
                "score": mean(scores[name]),
                "count": len(scores[name]),
                "ttft_s": mean(times[name]),
                "recomputed_share": mean(recomputed[name]),
                "same_answer_as_full": mean([float(x) for x in same_as_full[name]]),
            }
            for name, _, _ in methods
        },
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
