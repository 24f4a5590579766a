set -u
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh >/dev/null; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
T0=$(date +%s)
B="bench/qwen3_omni/bench_omni.py --device cuda --layout split --root /tmp/omA"
rm -rf /tmp/tp
timeout 330 python3 $B --parts mstar --concurrency 1,16 --torch-profile /tmp/tp --profile-streams 16 --out $OUT/omni_mstar.json > $OUT/omni_mstar_log.txt 2>&1
echo "mstar at $(( $(date +%s)-T0 ))"; grep '^{' $OUT/omni_mstar_log.txt | head -4
timeout $(( 560 - $(date +%s) + T0 )) python3 $B --parts baseline --concurrency 16 --baseline-concurrency 16 --out $OUT/omni_baseline.json > $OUT/omni_baseline_log.txt 2>&1 &
BP=$!
mkdir -p $OUT/profile16
for f in /tmp/tp/*.trace.json.gz; do n=$(basename $f .trace.json.gz); timeout 120 nice python3 bench/trace_gaps.py $f --top 12 > $OUT/profile16/$n.gaps.txt 2>&1; done
cp /tmp/tp/*.txt $OUT/profile16/ 2>/dev/null; ls -la /tmp/tp | head
wait $BP
echo "baseline at $(( $(date +%s)-T0 ))"; grep '^{' $OUT/omni_baseline_log.txt | head -2
