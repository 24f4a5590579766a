set -u
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh >/dev/null; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
T0=$(date +%s)
left() { echo $(( 585 - $(date +%s) + T0 )); }
timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/qwen3_omni/test_decode_graphs.py -k "cuda or device_once" > $OUT/cuda_tests.txt 2>&1
echo "tests done at $(( $(date +%s)-T0 )) s"; tail -3 $OUT/cuda_tests.txt
B="bench/qwen3_omni/bench_omni.py --device cuda --parts mstar --layout split --root /tmp/omA"
timeout 260 python3 $B --concurrency 1,16 --out $OUT/omni_after.json > $OUT/omni_after_log.txt 2>&1
echo "after done at $(( $(date +%s)-T0 )) s"; grep '^{' $OUT/omni_after_log.txt
(cd .ab/old && PYTHONPATH=$PWD:/tmp/wh timeout $(( $(left) - 10 )) python3 $B --concurrency 1,16 --out $OUT/omni_before.json > $OUT/omni_before_log.txt 2>&1)
echo "before done at $(( $(date +%s)-T0 )) s"; grep '^{' $OUT/omni_before_log.txt
grep -h "captured\|compil" $OUT/omni_after_log.txt | head -5
