#!/usr/bin/env bash
# The GPU-path measurements (BENCHMARKS.md, "Peer hits on GPU" and "CPU offload"): the GPU tier
# (local_gpu) and layer-wise loads (use_layerwise) against the staged baseline, on the H200
# (vLLM 0.25.1 and NIXL staged as ../shared/device/README.md says). Steps run in the order given;
# a failed step is recorded and the next one runs:
#
#   bash benchmarks/gpu/run_gpu_paths.sh [-w WORKDIR] STEP...    # WORKDIR defaults to /tmp/gpu-paths
#   bash benchmarks/gpu/run_gpu_paths.sh [-w WORKDIR] --poll S   # wait up to S s for "all done", copy to $OUT
#
#   kernels      build (or load) csrc's kernels, timed; the device checksum of a document, kernel vs torch
#   tests        the GPU-marked tests of the tier, layer-wise loads, staging, the store and the kernels
#   tests-loads  of those, the kernels', layer-wise loads' and loads beside the steps' only
#   tests-engines  the GPU tests that start vLLM engines: loads beside the steps, preemption under
#                asynchronous scheduling and during pending loads, the cap on loads in flight
#                (vLLM >= 0.34), the TP=2 pair (two GPUs)
#   tests-v1     loads beside the steps and the preemption test on vLLM's V1 model runner
#                (VLLM_USE_V2_MODEL_RUNNER=0; V2 is the default on GPUs; 0.34 has no V1: skipped)
#   pd           seed 000's prefill/decode through MultiConnector (benchmarks/gpu/pd.py)
#   tp           two TP=2 engines sharing KV rank by rank (benchmarks/bench_tp.py; two GPUs)
#   peer-base    e2e peer, both engines on GPU 0, no GPU tier (12 documents x 3 repeats)
#   peer-tier    the same with a 16 GB GPU tier on each engine
#   curve        peer/cold and peer/own-hit at 2K, 8K, 16K and 32K-token documents (4 in flight, as
#                many documents as fit 128K tokens, at most 12 and at least 4), over NIXL then over tcp, CUDA graphs,
#                0.45 of the card per engine (CURVE_UTIL); CURVE_REPEATS waves per length (default 1)
#   peer-base-2  / peer-tier-2: one engine per GPU (nvidia-h200-x2)
#   peer-...@K=V,K=V  a peer step with config keys set on both engines (e2e.py --set), written
#                as e.g. peer_tier@p2p_batch_chunks=16 (several variants side by side in one run);
#                an item starting with -- is passed to e2e.py as it is (peer-tier@--graphs), so an
#                option with a value is one item: peer-base@--graphs,--repeats=2
#   offload      seed 002's offload runs: connector off, on, on with use_layerwise
#   offload-async    seed 002's offload runs with the connector on, then on with async_kv_loads
#                (side by side, alternating twice)
#   offload-profile  run 2 with use_layerwise under torch.profiler, then again under cProfile
#   blend        the blend's GPU tests, benchmarks/gpu/blend_profile.py (8,192 tokens, 8B shape, no vLLM), then
#                bench_blend.py --engine with a 20 GB pool (BLEND_PROMPTS prompts, default 6)
#   blend-stream  bench_blend.py --engine --stream 200 (BLEND_STREAM): 200 prompts in a row over 12 recurring
#                documents, full prefill against naive reuse and a 15% blend, TTFT per quarter of the run
#   offload@A,B  seed 002's offload, connector on, run 2 three times, with e2e.py arguments A B
#                as they are (offload@--graphs,--async-loads; offload@--connector,off,--graphs)
#
# Each step appends "STEP rc=N seconds=S" to WORKDIR/status and writes its JSON and log into
# WORKDIR. A GPU device call can start it detached (setsid) and poll WORKDIR/status:
#   setsid nohup bash benchmarks/gpu/run_gpu_paths.sh tests peer-tier ... >/tmp/paths.log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/../.."
W=/tmp/gpu-paths
if [ "${1:-}" = "-w" ]; then W=$2; shift 2; fi
if [ "${1:-}" = "--poll" ]; then  # wait up to $2 s for "all done", then copy what is there to $OUT
  end=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$end" ] && ! grep -q "all done" "$W/status" 2>/dev/null; do sleep 5; done
  cat "$W/status" 2>/dev/null
  # One archive: a device call brings back only a few files. Each step's JSON, log and status,
  # the engines' and controller's logs, the profile's summaries (not its trace).
  [ -n "${OUT:-}" ] && ( cd "$W" && tar czf "$OUT/results.tgz" --ignore-failed-read status \
    $(ls *.json *.txt *.log */engine*.log */controller.log profile/*.txt 2>/dev/null) ) || true
  exit 0
fi
[ $# -gt 0 ] || { echo "steps: kernels tests tests-loads tests-engines tests-v1 pd tp blend blend-stream curve peer-base peer-tier peer-base-2 peer-tier-2 offload offload-async offload-profile (peer-...@K=V,K=V: with config keys; values without commas; offload@A,B: with e2e.py offload's arguments)" >&2; exit 2; }
PY=${PYTHON:-python3}
mkdir -p "$W"
: > "$W/status"  # this run's steps only (--poll waits for its "all done")
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
MODEL="$W/llama-3.1-8b-shape"
model() { [ -d "$MODEL" ] || $PY benchmarks/gpu/e2e.py model --out "$MODEL" > "$W/model.json"; }
# Same documents, engines and GPU memory for the baseline and the tier: 0.3 of the card per engine
# leaves room for two 16 GB tiers beside two engines on one H200; 20 GB pinned pools each (two of
# 40 GB were killed at start-up on the 128 GiB host).
# On an 80 GB card (H100) two engines and two tiers need TIER_GB=6 PEER_UTIL=0.35 or so.
PEER=(peer --docs 12 --repeats 3 --gpu-util "${PEER_UTIL:-0.3}" --cpu-gb 20)
TIER=(--gpu-tier-gb "${TIER_GB:-16}")
peer() {  # name, gpus, extra args
  local name=$1 gpus=$2; shift 2
  model && $PY benchmarks/gpu/e2e.py "${PEER[@]}" --model "$MODEL" --workdir "$W/$name" --gpus "$gpus" "$@" \
    > "$W/$name.json" 2> "$W/$name.log"
}
offload() {  # name, extra args
  local name=$1; shift
  model && $PY benchmarks/gpu/e2e.py offload --model "$MODEL" "$@" > "$W/$name.json" 2> "$W/$name.log"
}
step() {
  local sets=() kv
  if [[ "$1" == peer*@* ]]; then  # peer-tier@K=V,K=V: the step, then its config keys
    IFS=, read -ra kv <<< "${1#*@}"
    for x in "${kv[@]}"; do if [[ "$x" == --* ]]; then sets+=("$x"); else sets+=(--set "$x"); fi; done
    VARIANT="@${1#*@}$AGAIN" run_step "${1%%@*}" "${sets[@]}"
    return
  fi
  if [[ "$1" == offload@* ]]; then  # offload@A,B: e2e.py offload's own arguments
    IFS=, read -ra kv <<< "${1#*@}"
    offload "$1$AGAIN" --connector on --run2-repeats 3 "${kv[@]}"
    return
  fi
  VARIANT="$AGAIN" run_step "$1"
}
run_step() {  # a step by name; peer steps pass extra e2e args on and name their output with $VARIANT
  local s=$1; shift
  case "$s" in
    kernels) $PY benchmarks/bench_kernels.py --checksum-only --reps 10 > "$W/kernels.log" 2>&1 ;;
    tests) $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_tier.py tests/test_layerwise.py \
      tests/test_gpu_staging.py tests/test_gpu_store.py tests/test_kernels.py tests/test_device_checksum.py \
      tests/test_gpu_async_loads.py \
      > "$W/gpu_tests.txt" 2>&1 ;;
    tests-loads) $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_gpu_async_loads.py \
      tests/test_layerwise.py > "$W/gpu_tests_loads.txt" 2>&1 ;;
    tests-engines) $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_async_loads.py tests/test_vllm_hooks.py \
      tests/test_gpu_load_lifecycle.py tests/test_gpu_tp.py > "$W/gpu_tests_engines.txt" 2>&1 ;;
    tests-v1) if $PY -c 'import sys, vllm; sys.exit(tuple(map(int, vllm.__version__.split(".")[:2])) < (0, 34))'; then
        echo "vLLM $($PY -c 'import vllm; print(vllm.__version__)') has no V1 model runner: skipped" > "$W/gpu_tests_v1.txt"; return 0; fi
      VLLM_USE_V2_MODEL_RUNNER=0 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_async_loads.py \
      tests/test_vllm_hooks.py > "$W/gpu_tests_v1.txt" 2>&1 ;;
    pd) model && $PY benchmarks/gpu/pd.py --model "$MODEL" --workdir "$W/pd$AGAIN" "$@" > "$W/pd$AGAIN.json" 2> "$W/pd$AGAIN.log" ;;
    tp) model && $PY benchmarks/bench_tp.py --tp 2 --gpu-util 0.4 --model "$MODEL" --dtype bfloat16 --channel nixl \
      --prompts 5 --words 7000 --gap-s 1 > "$W/tp$AGAIN.json" 2> "$W/tp$AGAIN.log" ;;
    peer-base) peer "peer_base$VARIANT" 0,0 "$@" ;;
    peer-tier) peer "peer_tier$VARIANT" 0,0 "${TIER[@]}" "$@" ;;
    curve) for ch in nixl tcp; do peer "curve_$ch$VARIANT" 0,0 --doc-tokens 2000,8000,16000,32000 --channel "$ch" \
        --graphs --gpu-util "${CURVE_UTIL:-0.45}" --repeats "${CURVE_REPEATS:-1}" "$@" || return; done ;;
    peer-base-2) peer "peer_base_2$VARIANT" 0,1 "$@" ;;
    peer-tier-2) peer "peer_tier_2$VARIANT" 0,1 "${TIER[@]}" "$@" ;;
    offload) offload offload_off --connector off && offload offload_on --connector on \
      && offload offload_layerwise --connector on --layerwise ;;
    offload-async) for i in 1 2; do offload "offload_on_$i" --connector on && offload "offload_async_$i" --connector on --async-loads || return; done ;;
    offload-profile) offload offload_profile --connector on --layerwise --profile-dir "$W/profile" ;;
    blend) $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_blend_core.py > "$W/blend_tests$AGAIN.txt" 2>&1
      $PY benchmarks/gpu/blend_profile.py --tokens 8192 --segments 6 --repeats 3 > "$W/blend_profile$AGAIN.json" \
        2> "$W/blend_profile$AGAIN.log"
      model && $PY benchmarks/bench_blend.py --engine --model "$MODEL" --dtype bfloat16 --kv-cache-mib 16384 \
        --cpu-gb 20 --prompts "${BLEND_PROMPTS:-6}" --long-docs 2000 --max-model-len 20000 \
        > "$W/blend_engine$AGAIN.json" 2> "$W/blend_engine$AGAIN.log" ;;
    blend-stream) model && $PY benchmarks/bench_blend.py --engine --stream "${BLEND_STREAM:-200}" \
        --methods full,naive,blend_0.15 --model "$MODEL" --dtype bfloat16 --kv-cache-mib 16384 --cpu-gb 20 \
        --long-docs 2000 --max-model-len 20000 > "$W/blend_stream$AGAIN.json" 2> "$W/blend_stream$AGAIN.log" ;;
    *) echo "unknown step $s" >&2; return 2 ;;
  esac
}
declare -A RUNS  # a peer or offload@ step given again writes its results as NAME#2, NAME#3, ...
for s in "$@"; do
  RUNS[$s]=$(( ${RUNS[$s]:-0} + 1 )); AGAIN=""; [ "${RUNS[$s]}" -gt 1 ] && AGAIN="#${RUNS[$s]}"
  t0=$(date +%s); echo "$s$AGAIN started $(date -u +%T)" >> "$W/status"
  step "$s"; rc=$?
  echo "$s$AGAIN rc=$rc seconds=$(( $(date +%s) - t0 ))" >> "$W/status"
done
echo "all done" >> "$W/status"
