#!/usr/bin/env bash
# V-JEPA 2's GPU runs (issue 34) in one device call, from the repository root:
#   bash bench/vjepa2/run_gpu.sh OUTDIR [PARTS]      PARTS: default plan,encoder (bench_vjepa2.py --parts, one process each)
# With .gw/fi/flashinfer-site.tar.xz (and its JIT cache fi-jit-cache.tgz) carried (FI= another folder), the
# encoder's fa3 variant has FlashInfer: its kernels for head_dim 64 are compiled in the background while
# the first part runs (MAX_JOBS of the 16 cores) unless the cache holds them, and a cache that grew comes
# back as OUTDIR/fi-jit-cache.tgz.
# LIMIT (default 570): seconds from the start by which every bench process is stopped. Writes gpu.txt,
# vjepa2_<part>.json, <part>_log.txt and prof/ (the best encoder variant's and the compiled plan's kernel
# tables).
set -u -o pipefail
OUT=${1:?OUTDIR}; PARTS=${2:-plan,encoder}; FI=${FI:-.gw/fi}
T0=$(date +%s)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
WARM=""
if [ -f $FI/flashinfer-site.tar.xz ]; then
  mkdir -p /tmp/site ~/.cache && tar -C /tmp/site -xJf $FI/flashinfer-site.tar.xz && export PYTHONPATH=$PYTHONPATH:/tmp/site
  if [ -f $FI/fi-jit-cache.tgz ]; then tar -C ~/.cache -xzf $FI/fi-jit-cache.tgz; fi
  MAX_JOBS=${MAX_JOBS:-12} python3 -c "
import torch
from mstar.services.engines.attn_flashinfer import DenseAttention
q = torch.randn(1, 256, 16, 64, device='cuda', dtype=torch.bfloat16)
DenseAttention(torch.device('cuda'), 'fa3')(q, q, q); torch.cuda.synchronize()" > "$OUT/fa3_jit_log.txt" 2>&1 &
  WARM=$!
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
for part in ${PARTS//,/ }; do
  if [ "$part" = encoder ] && [ -n "$WARM" ]; then wait $WARM; echo "fa3 JIT done at $(( $(date +%s) - T0 )) s"; fi
  timeout $(( ${LIMIT:-570} - $(date +%s) + T0 )) python3 bench/vjepa2/bench_vjepa2.py --device cuda --parts $part \
    --out "$OUT/vjepa2_$part.json" --profile "$OUT/prof" > "$OUT/${part}_log.txt" 2>&1
  echo "$part: rc $? at $(( $(date +%s) - T0 )) s"; tail -n 4 "$OUT/${part}_log.txt"
done
# the JIT cache back only when something was built (a call returns at most 8 files)
if grep -qs "Building JIT" "$OUT/fa3_jit_log.txt"; then tar -C ~/.cache -czf "$OUT/fi-jit-cache.tgz" flashinfer; fi
