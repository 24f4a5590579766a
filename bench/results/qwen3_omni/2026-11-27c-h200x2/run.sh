# issue 32, TP=2: the Thinker's decode pass with the slot cache attended in place (new) against 48efe53 (old, .ab/old), one call
set -u
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh >/dev/null; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
T0=$(date +%s)
timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/engines/test_attn_triton.py tests/qwen3_omni/test_decode_graphs.py tests/qwen3_omni/test_thinker_tp.py > $OUT/gpu_tests.txt 2>&1
echo "tests at $(( $(date +%s)-T0 ))"; tail -2 $OUT/gpu_tests.txt
D="bench/qwen3_omni/decode_step.py --device cuda --parts thinker --tp 2 --compiled --root /tmp/omni-m"
timeout 200 python3 $D --batch 1,16 --profile $OUT/prof_new --out $OUT/new.json > $OUT/new_log.txt 2>&1
echo "new at $(( $(date +%s)-T0 ))"; grep thinker $OUT/new_log.txt
(cd .ab/old && PYTHONPATH=$PWD:/tmp/wh timeout 180 python3 $D --batch 1,16 --out $OUT/old.json > $OUT/old_log.txt 2>&1)
echo "old at $(( $(date +%s)-T0 ))"; grep thinker $OUT/old_log.txt
timeout $(( 585 - $(date +%s) + T0 )) python3 $D --batch 16 --out $OUT/new2.json > $OUT/new2_log.txt 2>&1
echo "new again at $(( $(date +%s)-T0 ))"; grep thinker $OUT/new2_log.txt
cd $OUT && tar czf prof_new.tgz prof_new && rm -rf prof_new
