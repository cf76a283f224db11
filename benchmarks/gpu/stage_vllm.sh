#!/usr/bin/env bash
# Stage a vLLM release, the torch it pins and NIXL for the GPU machine (no package index there;
# Python 3.12, torch 2.11.0+cu130 and CUDA 13.0 in its image), from the project root here:
#
#   bash benchmarks/gpu/stage_vllm.sh 0.33.0     # vLLM 0.33.0 with torch 2.14.0 (default)
#   bash benchmarks/gpu/stage_vllm.sh 0.34.0     # vLLM 0.34.0: the same torch, plus the CuTe DSL it imports
#   bash benchmarks/gpu/stage_vllm.sh 0.25.1     # vLLM 0.25.1 on the image's own torch 2.11
#
# It downloads (once, cached in ~/.cache/gpu-wheels) the wheels the image lacks or has at another
# version, packs them into one tar split in parts under 56 MB (the device takes 64 MiB of working
# tree a call), one ignored folder each (.gpu/p00 ...), and prints the device calls: one call per
# part, one right after the other (a machine is given back after 30 s idle), then the install:
#
#   run(command="mkdir -p /tmp/gpu && cp .gpu/p00/* /tmp/gpu/", carry=[".gpu/p00"])   ... each part
#   run(command="bash benchmarks/gpu/install_vllm.sh && source /tmp/gpu/env.sh && <your command>")
#
# What is carried for 0.33.0 and why (the image's versions from `pip list` there, 2026-11-28):
# torch 2.14.0 (vLLM's pin; its C++ extensions are built against it), triton 3.8 (torch 2.14's;
# the image has 3.6), torchvision 0.29.0 (built for torch 2.14: the image's 0.26 fails to load
# beside it). Not carried, the image's being ABI-compatible with what torch 2.14 asks for:
# cuDNN 9.19 (torch wants 9.24; vLLM runs no cuDNN kernel), cuSPARSELt 0.8.0 (0.8.1), cuBLAS
# 13.1.0.3 (13.1.1.3). NCCL is carried: torch 2.14 calls ncclCommResume, which the image's 2.28.9
# lacks (`import torch` fails), and PyPI has no 2.30.7, so 2.32.3 (install_vllm.sh preloads it,
# ahead of the image's copy that the loader would otherwise find first). Not carried
# either: flashinfer and vLLM's other optional kernel packages (the runs set
# VLLM_USE_FLASHINFER_SAMPLER=0 and use vLLM's own FlashAttention).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
VERSION=${1:-0.33.0}
mkdir -p .git/info; grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
dl=${GPU_WHEEL_CACHE:-$HOME/.cache/gpu-wheels}/vllm-$VERSION; mkdir -p "$dl"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$dl" "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# What vLLM imports on the way to an engine and its OpenAI server that the image lacks, and what
# this project needs there (pyzmq, msgspec, fastapi, uvicorn, xxhash, redis; httpx and pyyaml are
# there). The 0.33 list was found by importing vLLM 0.33 and this project on torch 2.14 with only
# the image's packages beside them (on a CPU host, Python 3.11).
common=(pyzmq msgspec cbor2 jiter distro pydantic pydantic-core annotated-types typing-inspection
  sniffio blake3 cachetools pybase64 setproctitle partial-json-parser "fastapi<0.137,>=0.133"
  "starlette>=1.0.1" uvicorn "prometheus-fastapi-instrumentator>=8.0.0" diskcache lark==1.2.2
  depyf==0.20.0 astor dill compressed-tensors==0.17.0 gguf "llguidance<1.8,>=1.7" outlines_core==0.2.14
  lm-format-enforcer==0.11.3 interegular watchfiles python-json-logger ijson loguru
  truststore xxhash redis fastapi-offline nixl-cu13==1.5.1)
case "$VERSION" in
  0.25.1)
    extra=(vllm==0.25.1 openai openai-harmony typing_extensions==4.16.0 "xgrammar<1.0.0,>=0.2.1" httpx2 httpcore2
      apache-tvm-ffi model-hosting-container-standards jmespath supervisor) ;;
  0.33.*|0.34.*)
    extra=("vllm==$VERSION" torch==2.14.0 "triton~=3.8.0" torchvision==0.29.0 "openai>=2.25.0" orjson
      "jsonschema>=4.23.0" jsonschema-specifications referencing rpds-py "mistral_common>=1.11.6"
      "oss-harmony>=0.0.11" xgrammar==0.2.8 "model-hosting-container-standards<1.0.0,>=0.1.14" jmespath
      "anthropic>=0.71.0" docstring-parser "opentelemetry-api>=1.27.0" "opentelemetry-sdk>=1.27.0"
      opentelemetry-semantic-conventions "opentelemetry-semantic-conventions-ai>=0.4.1" nvtx==0.2.15
      "numba==0.65.0" "llvmlite<0.48,>=0.47" pycountry pydantic-extra-types apache-tvm-ffi==0.1.11 httpx2 httpcore2
      nvidia-nccl-cu13==2.32.3) ;;
  *) echo "stage_vllm.sh: no wheel list for vLLM $VERSION (0.25.1, 0.33.x and 0.34.x are known)" >&2; exit 2 ;;
esac
# vLLM 0.34 imports NVIDIA's CuTe DSL and quack at every CUDA engine's warm-up (MiniMax-M3's
# kernels, whatever the model): without them the engine core fails to start ("No module named
# 'cutlass'", then 'quack'), seen 2026-12-06 on an H100.
case "$VERSION" in
  0.34.*) extra+=(nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0
      nvidia-cutlass-dsl-libs-cu13==4.8.0 "cuda-bindings>=13.0,<14" quack-kernels==0.6.5 torch-c-dlpack-ext einops
      "protobuf>=4.21.12") ;;
esac
for d in "${common[@]}" "${extra[@]}"; do get "$d"; done
# One version of each distribution (the newest pip fetched), in one tar, split in parts.
rm -rf .gpu; mkdir -p .gpu
python3 - "$dl" .gpu/wheels.list <<'PY'
import pathlib, re, sys
from packaging.version import Version
best = {}
for wheel in pathlib.Path(sys.argv[1]).glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key not in best or Version(version) > Version(best[key][0]):
        best[key] = (version, wheel)
pathlib.Path(sys.argv[2]).write_text("".join(f"{w.name}\n" for _, w in sorted(best.values(), key=lambda v: v[1].name)))
PY
tar -C "$dl" -cf .gpu/wheels.tar -T .gpu/wheels.list
sha256sum .gpu/wheels.tar | cut -c1-64 > .gpu/wheels.sha256
split -b 56000000 -d -a 2 .gpu/wheels.tar .gpu/wheels.part
n=0
for part in .gpu/wheels.part*; do
  d=$(printf '.gpu/p%02d' "$n"); mkdir -p "$d"; mv "$part" "$d/"; n=$((n + 1))
done
cp .gpu/wheels.sha256 .gpu/p00/
echo "$VERSION" > .gpu/p00/vllm.version
rm .gpu/wheels.tar
echo "staged vLLM $VERSION: $(wc -l < .gpu/wheels.list) wheels, $n parts ($(du -sh .gpu | cut -f1))"
cat <<MSG
Device calls, one right after another (a machine is given back after 30 s idle):
  run(command="mkdir -p /tmp/gpu && cp .gpu/pNN/* /tmp/gpu/", carry=[".gpu/pNN"])   for NN = 00 .. $(printf '%02d' $((n - 1)))
  run(command="bash benchmarks/gpu/install_vllm.sh && source /tmp/gpu/env.sh && <your command>")
Each later call on the same warm machine begins with: source /tmp/gpu/env.sh
MSG
