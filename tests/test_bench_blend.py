"""benchmarks/bench_blend.py's own parts that its figures rest on: the engine warm-up's token ids are
valid for whatever model the benchmark runs (including the random-weight models built with a
locally trained tokenizer of a few hundred tokens: vLLM refuses an id past the vocabulary, and the
benchmark then crashed on its first request); the answers are scored as the docstring says, for
one module and for the two-document question; and the 95% intervals are Wilson's."""

from __future__ import annotations

from benchmark_scripts import load_benchmark
from transformers import AutoTokenizer


def bench_blend():
    return load_benchmark("bench_blend.py")


def test_the_warm_up_prompt_is_inside_a_small_locally_trained_vocabulary_and_under_a_chunk(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = bench_blend().warmup_ids(tokenizer)
    assert len(ids) == 64  # under a 256-token chunk: never stored, never blended
    assert all(0 <= i < len(tokenizer) for i in ids), (len(tokenizer), sorted(set(ids))[-5:])
    assert tokenizer.decode(ids).startswith("Before its first request")


def test_a_one_module_answer_is_right_only_when_its_first_word_names_the_module():
    scores = bench_blend().answer_scores
    assert scores(" json, a module for JSON.\nMore", "json") == (True, 2 * (1 / 5) / (1 / 5 + 1))
    assert scores(" The json module", "json")[0] is False  # named, but not first
    assert scores(" pathlib", "json") == (False, 0.0)


def test_a_two_document_answer_is_right_only_when_both_modules_are_named_in_its_first_line():
    scores = bench_blend().answer_scores
    assert scores(" json and pathlib.", "json pathlib") == (True, 0.8)  # 2 of 3 words, both names
    assert scores(" pathlib, json", "json pathlib")[0] is True  # in either order
    exact, f1 = scores(" json only\npathlib", "json pathlib")  # the second name past the first line
    assert exact is False and 0 < f1 < 1


def test_the_95_percent_interval_brackets_the_share_and_stays_within_zero_and_one():
    wilson = bench_blend().wilson
    assert wilson(0, 48)[0] == 0.0 and 0.05 < wilson(0, 48)[1] < 0.1  # none of 48: still up to ~7%
    assert wilson(48, 48)[1] == 1.0 and 0.9 < wilson(48, 48)[0] < 0.95
    low, high = wilson(22, 48)
    assert low < 22 / 48 < high and abs((low + high) / 2 - 22 / 48) < 0.02
    assert wilson(0, 0) == [0.0, 1.0]


def test_the_task_score_is_a_share_with_its_count_and_interval_under_the_name_the_summary_keeps():
    bench = bench_blend()
    scores = bench.task_scores([(True, 1.0), (False, 0.5), (True, 0.5), (False, 0.0)])
    assert scores["task_exact_share"] == 0.5 and scores["task_exact_count"] == [2, 4]
    assert scores["task_exact_ci95"] == bench.wilson(2, 4) and scores["task_f1"] == 0.5
    assert bench.task_scores([]) == {}  # without --task


def test_a_pair_question_quotes_two_different_documents_and_its_answer_names_their_modules():
    bench = bench_blend()
    docs = [f"Module m{i}: " + " ".join(f"w{i}_{j}" for j in range(40)) for i in range(8)]
    import random

    for seed in range(20):
        chosen, prompt, answer = bench.build_prompt(random.Random(seed), docs, "pair")
        first, second = answer.split()
        assert first != second and {first, second} <= {d.split(":")[0].split()[-1] for d in chosen}
        quotes = [q for q in prompt.split('"')[1::2]]
        assert quotes[0].startswith(f"w{first[1:]}_") and quotes[1].startswith(f"w{second[1:]}_"), quotes
