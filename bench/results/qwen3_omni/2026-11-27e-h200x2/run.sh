# issue 32, TP=2: small all-reduces through the symmetric-memory one-shot kernel (new) against NCCL (b63e13e, .ab/old), one call
set -u
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh >/dev/null; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
T0=$(date +%s)
timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/engines/test_tensor_parallel.py tests/qwen3_omni/test_thinker_tp.py > $OUT/gpu_tests.txt 2>&1
echo "tests at $(( $(date +%s)-T0 ))"; tail -2 $OUT/gpu_tests.txt
D="bench/qwen3_omni/decode_step.py --device cuda --parts thinker --tp 2 --compiled --root /tmp/omni-m --batch 1,16"
timeout 220 python3 $D --out $OUT/new.json > $OUT/new_log.txt 2>&1
echo "new at $(( $(date +%s)-T0 ))"; grep thinker $OUT/new_log.txt; grep -i "one-shot\|symm" $OUT/new_log.txt | head -3
(cd .ab/old && PYTHONPATH=$PWD:/tmp/wh timeout $(( 585 - $(date +%s) + T0 )) python3 $D --out $OUT/old.json > $OUT/old_log.txt 2>&1)
echo "old at $(( $(date +%s)-T0 ))"; grep thinker $OUT/old_log.txt
