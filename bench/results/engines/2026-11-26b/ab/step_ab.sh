#!/usr/bin/env bash
# Same-call A/B of the decode step's inter-step work: old (HEAD: sampler numbers uploaded between
# the LM head and the sampler, tokens downloaded on the compute stream), new (working tree:
# uploaded ahead on the upload stream, downloaded on a side stream), kcopy (new + the graph's
# token-id copy as a kernel, not a DtoD memcpy). One process per run, rounds interleaved.
set -u -o pipefail
OUT=$1; ROUNDS=${2:-3}
T0=$(date +%s)
mkdir -p /tmp/site && tar -C /tmp/site -xJf .fi/flashinfer-site.tar.xz
mkdir -p ~/.cache && tar -C ~/.cache -xzf .fi/fi-jit-cache.tgz
mkdir -p /tmp/arms/old /tmp/arms/new /tmp/arms/kcopy
cp -r .ab/old/services /tmp/arms/old/ && cp -r services /tmp/arms/new/ && cp -r services /tmp/arms/kcopy/
sed -i 's/g.ids\[:n\].copy_(token_ids, non_blocking=True)/torch.mul(token_ids, 1, out=g.ids[:n])/' /tmp/arms/kcopy/services/engines/cuda_graphs.py
grep -c "torch.mul(token_ids" /tmp/arms/kcopy/services/engines/cuda_graphs.py
for a in old new kcopy; do
  mkdir -p /tmp/pkg_$a/mstar && for f in mstar/*; do ln -sfn "$PWD/$f" /tmp/pkg_$a/mstar/; done
  for d in models conductor gateway; do ln -sfn "$PWD/$d" /tmp/pkg_$a/mstar/$d; done
  ln -sfn /tmp/arms/$a/services /tmp/pkg_$a/mstar/services
done
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
(cd tests/engines && PYTHONPATH=/tmp/pkg_new:/tmp/site python -m pytest . -m gpu -q -o addopts="" -p no:cacheprovider 2>&1) \
  | tee "$OUT/pytest_gpu.txt" | tail -n 3
echo "== tests done at $(( $(date +%s) - T0 )) s"
run() {
  PYTHONPATH=/tmp/pkg_$1:/tmp/site python bench/engines/decode_bench.py --out "$OUT/db-$1-$2.json" \
    --batches 1,8,16,32,64 --max-num-seqs 64 --hf-order '' 2>&1 | grep -E '^(ours [0-9]|\{"sanity)' | sed "s/^/$1 $2: /" | cut -c1-200
}
for r in $(seq 1 "$ROUNDS"); do
  for a in old new kcopy; do
    if (( $(date +%s) - T0 > 500 )); then echo "== out of time before $a $r"; break 2; fi
    run $a $r
  done
done
python - "$OUT" <<'PY'
import json, sys, glob, statistics
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/db-*.json")):
    v, r = f.rsplit("/", 1)[1][3:-5].split("-")
    d = json.load(open(f))
    for b, x in d.get("ours", {}).items():
        rows.setdefault((v, int(b)), []).append((x["decode_step_ms_median"], x.get("step_over_floor")))
for (v, b), xs in sorted(rows.items(), key=lambda k: (k[0][1], k[0][0])):
    print(f"{v:5s} batch {b:3d}: " + " ".join(f"{x:.4f}" for x, _ in xs) + f"  mean {statistics.mean(x for x, _ in xs):.4f}"
          + "  /floor " + " ".join(f"{y:.4f}" for _, y in xs if y))
PY
echo "== done at $(( $(date +%s) - T0 )) s"
