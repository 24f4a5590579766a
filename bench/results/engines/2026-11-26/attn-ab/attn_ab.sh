#!/usr/bin/env bash
# Same-call A/B of the fused decode kernel: old (idle split programs run the prologue), new (they
# exit at once), new + 64-token KV blocks at batch 16; ABCABC, one process per run.
set -u -o pipefail
OUT=$1
mkdir -p /tmp/site && tar -C /tmp/site -xJf .fi/flashinfer-site.tar.xz
mkdir -p ~/.cache && tar -C ~/.cache -xzf .fi/fi-jit-cache.tgz
mkdir -p /tmp/pkg/mstar && for f in mstar/*; do ln -sfn "$PWD/$f" /tmp/pkg/mstar/; done
for d in services models conductor gateway; do ln -sfn "$PWD/$d" /tmp/pkg/mstar/$d; done
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
A=services/engines/attn_triton.py
cp $A /tmp/new.py
(cd tests/engines && python -m pytest . -m gpu -q -o addopts="" -p no:cacheprovider 2>&1) | tee "$OUT/pytest_gpu.txt" | tail -n 3
run() {
  python bench/engines/decode_bench.py --out "$OUT/db-$1-$2.json" --batches 1,8,16,32 --max-num-seqs 32 --hf-order '' \
    2>&1 | grep -E '^(ours [0-9]|\{"sanity)' | sed "s/^/$1 $2: /" | cut -c1-220
}
for r in 1 2; do
  cp .ab/attn_old.py $A; run old $r
  cp /tmp/new.py $A; run new $r
  sed 's/BLOCK_N, BLOCK_N_FEW, MANY_SEQS = 64, 128, 32/BLOCK_N, BLOCK_N_FEW, MANY_SEQS = 64, 128, 16/' /tmp/new.py > $A; run b64 $r
done
cp /tmp/new.py $A
python - "$OUT" <<'PY'
import json, sys, glob, statistics
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/db-*.json")):
    v, r = f.rsplit("/", 1)[1][3:-5].split("-")
    d = json.load(open(f))
    for b, x in d["ours"].items():
        rows.setdefault((v, int(b)), []).append(x["decode_step_ms_median"])
for (v, b), xs in sorted(rows.items(), key=lambda k: (k[0][1], k[0][0])):
    print(f"{v:4s} batch {b:3d}: " + " ".join(f"{x:.4f}" for x in xs) + f"  mean {statistics.mean(xs):.4f}")
PY
tar -C ~/.cache -czf "$OUT/fi-jit-cache.tgz" flashinfer
