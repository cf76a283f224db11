#!/usr/bin/env bash
# On the GPU machine, after stage_vllm.sh's parts were copied to /tmp/gpu: check and unpack them,
# install every wheel without its dependencies into /tmp/gpu/site (ahead of the image's packages
# on PYTHONPATH, so a carried torch replaces the image's), and write /tmp/gpu/env.sh. The project
# runs from the working tree: its vLLM plugin entry point and console scripts are put beside it.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
cd /tmp/gpu
if ls wheels.part* > /dev/null 2>&1; then
  cat $(ls wheels.part* | sort) > wheels.tar
  echo "$(cat wheels.sha256)  wheels.tar" | sha256sum -c --quiet -
  rm -f wheels.part*
  mkdir -p wheels && tar -C wheels -xf wheels.tar && rm wheels.tar
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu/site wheels/*.whl
# A --target install leaves the wheels' .pth files unread (Python reads them only in its site
# directories), and NVIDIA's CuTe DSL finds its `cutlass` package through one: vLLM 0.34's engine
# core then fails at warm-up with "No module named 'cutlass'". This makes the folder a site
# directory for every process that has it on PYTHONPATH.
printf 'import site\nsite.addsitedir("/tmp/gpu/site")\n' > /tmp/gpu/site/sitecustomize.py
# nixl_cu13 installs its module as nixl_cu13; the code imports nixl (PyPI's meta package would).
[ -d /tmp/gpu/site/nixl_cu13 ] && ln -sfn nixl_cu13 /tmp/gpu/site/nixl
# The project's plugin entry point (vLLM finds general plugins through distribution metadata)
# and its console scripts, for a checkout on PYTHONPATH.
meta=/tmp/gpu/site/lmcache_p2p-0.0.0.dist-info
mkdir -p "$meta" /tmp/gpu/bin
printf 'Metadata-Version: 2.1\nName: lmcache-p2p\nVersion: 0.0.0\n' > "$meta/METADATA"
printf '[vllm.general_plugins]\nlmcache_p2p = lmcache_p2p.integration.vllm.plugin:register\n' > "$meta/entry_points.txt"
for script in lmcache_controller:lmcache_p2p.controller.cli lmcache-p2p:lmcache_p2p.cli \
  lmcache_server:lmcache_p2p.remote.server lmcache_vllm:lmcache_p2p.integration.vllm.launcher \
  lmcache_router:lmcache_p2p.router.cli; do
  printf '#!/bin/sh\nexec python3 -c "import sys; from %s import main; sys.exit(main())" "$@"\n' "${script#*:}" \
    > "/tmp/gpu/bin/${script%%:*}"
  chmod +x "/tmp/gpu/bin/${script%%:*}"
  # also beside the interpreter, where the benchmarks look for them (sys.executable's folder)
  ln -sf "/tmp/gpu/bin/${script%%:*}" "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/" 2>/dev/null || true
done
cat > /tmp/gpu/env.sh <<ENV
export PYTHONPATH=$here:/tmp/gpu/site\${PYTHONPATH:+:\$PYTHONPATH} PATH=/tmp/gpu/bin:\$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ENV
# A carried NCCL (torch 2.14 needs a newer one than the image's) is preloaded in every process
# that sources env.sh, pytest and the engines alike: the image's copy is otherwise found first.
nccl=/tmp/gpu/site/nvidia/nccl/lib/libnccl.so.2
[ -f "$nccl" ] && echo "export LD_PRELOAD=$nccl\${LD_PRELOAD:+:\$LD_PRELOAD}" >> /tmp/gpu/env.sh
source /tmp/gpu/env.sh
python3 -c "import torch, vllm; print('installed: vLLM', vllm.__version__, 'torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.is_available())"
