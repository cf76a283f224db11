#!/usr/bin/env bash
# Issue 21's measurements: the GPU tier (local_gpu) and layer-wise loads (use_layerwise) against
# the staged baseline, on the H200 (vLLM 0.25.1 and NIXL staged as ../shared/device/README.md
# says). One step per call, each under the device's 10-minute limit:
#
#   bash benchmarks/gpu/run_gpu_paths.sh STEP [WORKDIR]    # WORKDIR defaults to /tmp/gpu-paths
#
#   tests        the GPU-marked tests of the tier, layer-wise loads, staging and the kernels
#   peer-base    e2e peer, both engines on GPU 0, no GPU tier (12 documents x 3 repeats)
#   peer-tier    the same with a 16 GB GPU tier on each engine
#   peer-base-2  / peer-tier-2: one engine per GPU (nvidia-h200-x2)
#   offload      seed 002's offload runs: connector off, on, on with use_layerwise
#
# Every step writes its JSON into WORKDIR ($OUT too, when set, so the device call returns it).
set -euo pipefail
cd "$(dirname "$0")/../.."
STEP=${1:?step: tests, peer-base, peer-tier, peer-base-2, peer-tier-2 or offload}
W=${2:-/tmp/gpu-paths}
PY=${PYTHON:-python3}
mkdir -p "$W"
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
$PY -c "from lmcache_p2p import kv_kernels; kv_kernels.load()"
MODEL="$W/llama-3.1-8b-shape"
[ -d "$MODEL" ] || $PY benchmarks/gpu/e2e.py model --out "$MODEL" > "$W/model.json"
# Same documents, engines and GPU memory for the baseline and the tier: 0.3 of the card per engine
# leaves room for two 16 GB tiers beside two engines on one H200.
PEER=(peer --model "$MODEL" --docs 12 --repeats 3 --gpu-util 0.3 --cpu-gb 50)
save() { cp "$W/$1" "${OUT:-$W}/" 2>/dev/null || true; }
case "$STEP" in
  tests)
    $PY -m pytest -q -m gpu tests/test_gpu_tier.py tests/test_layerwise.py tests/test_gpu_staging.py \
      tests/test_kernels.py 2>&1 | tee "$W/gpu_tests.txt"; save gpu_tests.txt ;;
  peer-base) $PY benchmarks/gpu/e2e.py "${PEER[@]}" --workdir "$W/pb" --gpus 0,0 > "$W/peer_base.json"; save peer_base.json ;;
  peer-tier) $PY benchmarks/gpu/e2e.py "${PEER[@]}" --workdir "$W/pt" --gpus 0,0 --gpu-tier-gb 16 > "$W/peer_tier.json"; save peer_tier.json ;;
  peer-base-2) $PY benchmarks/gpu/e2e.py "${PEER[@]}" --workdir "$W/pb2" --gpus 0,1 > "$W/peer_base_2.json"; save peer_base_2.json ;;
  peer-tier-2) $PY benchmarks/gpu/e2e.py "${PEER[@]}" --workdir "$W/pt2" --gpus 0,1 --gpu-tier-gb 16 > "$W/peer_tier_2.json"; save peer_tier_2.json ;;
  offload)
    for c in off on; do
      $PY benchmarks/gpu/e2e.py offload --model "$MODEL" --connector $c > "$W/offload_$c.json" 2> "$W/offload_$c.log"; save "offload_$c.json"
    done
    $PY benchmarks/gpu/e2e.py offload --model "$MODEL" --connector on --layerwise > "$W/offload_layerwise.json" \
      2> "$W/offload_layerwise.log"; save offload_layerwise.json ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
