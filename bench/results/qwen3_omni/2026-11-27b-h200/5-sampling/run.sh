set -u
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh >/dev/null; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
T0=$(date +%s)
B="bench/qwen3_omni/bench_omni.py --device cuda --parts mstar --layout split --root /tmp/omA --concurrency 1,16"
timeout 200 python3 $B --out $OUT/omni_generators.json > $OUT/omni_generators_log.txt 2>&1
echo "A at $(( $(date +%s)-T0 ))"; grep '^{' $OUT/omni_generators_log.txt | head -2
(cd .ab/old && PYTHONPATH=$PWD:/tmp/wh timeout $(( 585 - $(date +%s) + T0 )) python3 $B --out $OUT/omni_one_draw.json > $OUT/omni_one_draw_log.txt 2>&1)
echo "B at $(( $(date +%s)-T0 ))"; grep '^{' $OUT/omni_one_draw_log.txt | head -2
