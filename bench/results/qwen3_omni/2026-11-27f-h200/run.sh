# issue 32: the routed experts of a decode pass as Triton kernels (new) against torch._grouped_mm (1bf0115, .ab/old), one H200, one call
set -u
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh >/dev/null; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
T0=$(date +%s)
timeout 130 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/engines/test_moe_triton.py tests/qwen3_omni/test_decode_graphs.py tests/qwen3_omni/test_compiled_layers.py > $OUT/gpu_tests.txt 2>&1
echo "tests at $(( $(date +%s)-T0 ))"; tail -2 $OUT/gpu_tests.txt
timeout 100 python3 bench/engines/moe_bench.py --sweep --out $OUT/moe_bench.json > $OUT/moe_bench_log.txt 2>&1
echo "moe bench at $(( $(date +%s)-T0 ))"; cat $OUT/moe_bench_log.txt | tail -4
D="bench/qwen3_omni/decode_step.py --device cuda --parts thinker talker --compiled --root /tmp/omni-m --batch 1,16"
timeout 150 python3 $D --out $OUT/new.json > $OUT/new_log.txt 2>&1
echo "new at $(( $(date +%s)-T0 ))"; grep -E "^(thinker|talker)" $OUT/new_log.txt
(cd .ab/old && PYTHONPATH=$PWD:/tmp/wh timeout $(( 500 - $(date +%s) + T0 )) python3 $D --out $OUT/old.json > $OUT/old_log.txt 2>&1)
echo "old at $(( $(date +%s)-T0 ))"; grep -E "^(thinker|talker)" $OUT/old_log.txt
