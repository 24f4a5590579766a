set -u
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh >/dev/null; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
T0=$(date +%s)
B="bench/qwen3_omni/bench_omni.py --device cuda --parts mstar --layout split --root /tmp/omA --concurrency 1,16"
timeout 190 python3 $B --model-kwargs '{"talker_gather_ms": 5}' --out $OUT/omni_gather5.json > $OUT/omni_gather5_log.txt 2>&1
echo "gather5 at $(( $(date +%s)-T0 ))"; grep '^{' $OUT/omni_gather5_log.txt | head -2
timeout 170 python3 $B --model-kwargs '{"talker_gather_ms": 0}' --out $OUT/omni_gather0.json > $OUT/omni_gather0_log.txt 2>&1
echo "gather0 at $(( $(date +%s)-T0 ))"; grep '^{' $OUT/omni_gather0_log.txt | head -2
(cd .ab/old && PYTHONPATH=$PWD:/tmp/wh timeout $(( 585 - $(date +%s) + T0 )) python3 $B --out $OUT/omni_before.json > $OUT/omni_before_log.txt 2>&1)
echo "before at $(( $(date +%s)-T0 ))"; grep '^{' $OUT/omni_before_log.txt | head -2
