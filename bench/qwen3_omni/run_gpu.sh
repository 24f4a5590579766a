#!/usr/bin/env bash
# Qwen3-Omni's GPU run (issue 32) in one device call, from the repository root, with .gpuwheels/ carried
# (see bench/bagel/run_gpu.sh):
#   bash bench/qwen3_omni/run_gpu.sh OUTDIR [smoke|full|tp] [BENCH_ARGS...]
# With three or more GPUs, M* (split layout: the Thinker on GPU 0, the Talker and Code2Wav on GPU 1) and
# the transformers baseline (GPU 2) run at once, each in its own process; else one after the other.
# tp (two GPUs): the Thinker's decode pass at TP=2 against TP=1 (decode_step.py --tp 2), then served
# with --layout tp2 and --layout split at 1 and 16 streams.
set -u -o pipefail
OUT=${1:?OUTDIR}; MODE=${2:-full}; shift 2 || shift $#
T0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } > "$OUT/gpu.txt"
N=$(nvidia-smi -L | wc -l)
ARGS=(--device cuda "$@"); [ "$MODE" = smoke ] && ARGS+=(--tiny)
rm -rf /tmp/omni-m /tmp/omni-b
TO=$(( 570 - $(date +%s) + T0 ))
if [ "$MODE" = tp ]; then
  timeout 240 python3 bench/qwen3_omni/decode_step.py --device cuda --parts thinker --batch 1,16 --tp 2 --root /tmp/omni-m \
    --out "$OUT/decode_step_tp2.json" > "$OUT/decode_step_tp2_log.txt" 2>&1
  stamp "decode step"
  HALF=$(( (570 - $(date +%s) + T0) / 2 ))
  for layout in tp2 split; do
    timeout $HALF python3 bench/qwen3_omni/bench_omni.py --device cuda --parts mstar \
      --layout $layout --concurrency 1,16 --root /tmp/omni-m --out "$OUT/omni_$layout.json" > "$OUT/omni_${layout}_log.txt" 2>&1
    stamp "served $layout"
  done
elif [ "$N" -ge 3 ]; then
  CUDA_VISIBLE_DEVICES=0,1 timeout $TO python3 bench/qwen3_omni/bench_omni.py "${ARGS[@]}" --parts mstar --root /tmp/omni-m \
    --out "$OUT/omni_mstar.json" > "$OUT/omni_mstar_log.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=2 timeout $TO python3 bench/qwen3_omni/bench_omni.py "${ARGS[@]}" --parts baseline --root /tmp/omni-b \
    --out "$OUT/omni_baseline.json" > "$OUT/omni_baseline_log.txt" 2>&1
  wait
else
  timeout $TO python3 bench/qwen3_omni/bench_omni.py "${ARGS[@]}" --out "$OUT/omni.json" > "$OUT/omni_log.txt" 2>&1
fi
stamp "done"
tail -n 8 "$OUT"/*_log.txt
