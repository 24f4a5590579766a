#!/usr/bin/env bash
# V-JEPA 2's GPU runs (issue 34) in one device call, from the repository root (nothing carried):
#   bash bench/vjepa2/run_gpu.sh OUTDIR [PARTS]   PARTS: default plan,encoder,rollout (bench_vjepa2.py --parts, one
#                                                 process each)
# ROLLOUT_ARGS (default: batch 100 at H 2 and 30, the recompute loop timed on 25 rows): the rollout part's sizes.
# LIMIT (default 570): seconds from the start by which every bench process is stopped. Writes gpu.txt,
# vjepa2_<part>.json, <part>_log.txt and prof/ (the best encoder variant's and the compiled plan's kernel tables).
set -u -o pipefail
OUT=${1:?OUTDIR}; PARTS=${2:-plan,encoder,rollout}
T0=$(date +%s)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
for part in ${PARTS//,/ }; do
  EXTRA=(); [ "$part" = rollout ] && EXTRA=(${ROLLOUT_ARGS:---rollout-batches 100 --horizons 2 30 --recompute-sample 25})
  timeout $(( ${LIMIT:-570} - $(date +%s) + T0 )) python3 bench/vjepa2/bench_vjepa2.py --device cuda --parts $part \
    "${EXTRA[@]}" --out "$OUT/vjepa2_$part.json" --profile "$OUT/prof" > "$OUT/${part}_log.txt" 2>&1
  echo "$part: rc $? at $(( $(date +%s) - T0 )) s"; grep -v Warn "$OUT/${part}_log.txt" | tail -n 4
done
