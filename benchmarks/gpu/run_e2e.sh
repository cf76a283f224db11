#!/usr/bin/env bash
# vLLM on one GPU host, end to end (issue 8): builds the Llama-3.1-8B-shape model, then the peer
# sharing run (controller + two vLLM engines on the seed-004 YAMLs), then the CPU offload runs
# with the connector on and off, then the report. Needs vLLM 0.25+ and NIXL installed next to this
# project; takes about 10 minutes on an H200.
#
#   bash benchmarks/gpu/run_e2e.sh [WORKDIR]      # WORKDIR defaults to /tmp/lmcache-e2e
#
# With two GPUs each engine gets its own (GPUS=0,1); with one they share it (GPUS=0,0).
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-/tmp/lmcache-e2e}
PY=${PYTHON:-python3}
mkdir -p "$W"
if [ -z "${GPUS:-}" ]; then
  if [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ]; then GPUS=0,1; else GPUS=0,0; fi
fi
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# Our kernel is built once before the engines start (its first build takes about a minute).
$PY -c "from lmcache_p2p import kv_kernels; kv_kernels.load()"
$PY benchmarks/gpu/e2e.py model --out "$W/llama-3.1-8b-shape" > "$W/model.json"
$PY benchmarks/gpu/e2e.py peer --model "$W/llama-3.1-8b-shape" --workdir "$W" --gpus "$GPUS" > "$W/peer.json"
for c in on off; do
  $PY benchmarks/gpu/e2e.py offload --model "$W/llama-3.1-8b-shape" --connector $c > "$W/offload_$c.json" 2> "$W/offload_$c.log"
done
$PY benchmarks/gpu/e2e.py report "$W"
