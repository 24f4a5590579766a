# issue 32: served speech with the slot cache attended in place (new) against 48efe53 (old, .ab/old), one H200, one call
set -u
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh >/dev/null; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
T0=$(date +%s)
B="bench/qwen3_omni/bench_omni.py --device cuda --parts mstar --layout split --root /tmp/omA --concurrency 1,16,32"
timeout 280 python3 $B --out $OUT/omni_new.json > $OUT/omni_new_log.txt 2>&1
echo "new at $(( $(date +%s)-T0 ))"; grep -E '^\{|first audio|audio s/s' $OUT/omni_new_log.txt | tail -6
(cd .ab/old && PYTHONPATH=$PWD:/tmp/wh timeout $(( 588 - $(date +%s) + T0 )) python3 $B --out $OUT/omni_old.json > $OUT/omni_old_log.txt 2>&1)
echo "old at $(( $(date +%s)-T0 ))"; grep -E '^\{|first audio|audio s/s' $OUT/omni_old_log.txt | tail -6
