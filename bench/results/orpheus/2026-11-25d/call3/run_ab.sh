#!/usr/bin/env bash
# One-off A/B/C (not committed): ring sampler (tree) vs sampler h2d (tree, sed) vs dc1c9d5 (ab_base)
set -u -o pipefail
OUT=${1:?OUT}; T0=$(date +%s); DL=${DL:-530}
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
mkdir -p /tmp/site && tar -C /tmp/site -xJf .fi/flashinfer-site.tar.xz
mkdir -p ~/.cache && tar -C ~/.cache -xzf .fi/fi-jit-cache.tgz
mkdir -p /tmp/wh && for w in .wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh; done
REPO=$PWD
mk() { mkdir -p $1/mstar && for f in mstar/*; do ln -sfn "$REPO/$f" $1/mstar/; done
  for d in models conductor gateway; do ln -sfn "$REPO/$d" $1/mstar/$d; done; ln -sfn $2 $1/mstar/services; }
cp -r services /tmp/base_services && cp ab_base/batch.py ab_base/cuda_graphs.py ab_base/kv_engine.py ab_base/sampling.py /tmp/base_services/engines/
cp -r /tmp/base_services /tmp/dl_services && cp services/engines/batch.py services/engines/kv_engine.py /tmp/dl_services/engines/
cp -r /tmp/base_services /tmp/gr_services && cp services/engines/batch.py services/engines/cuda_graphs.py /tmp/gr_services/engines/
mk /tmp/pkg "$REPO/services"; mk /tmp/pkgb /tmp/base_services; mk /tmp/pkgd /tmp/dl_services; mk /tmp/pkgg /tmp/gr_services
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
stamp ckpt
(cd bench/orpheus && PYTHONPATH=/tmp/pkg:/tmp/wh:/tmp/site python -c "from pathlib import Path; from bench_orpheus import write_checkpoints as w; w(Path('/tmp/orpheus-ckpt'), tiny=False)" 2>&1 | grep -v Warning | tail -1)
i=0
sync; sleep 20
for V in base dl gr ring gr base ring dl dl ring base gr; do
  i=$((i+1)); [ $(left) -lt 40 ] && break
  P=/tmp/pkg; [ $V = base ] && P=/tmp/pkgb; [ $V = dl ] && P=/tmp/pkgd; [ $V = gr ] && P=/tmp/pkgg
  (cd bench/orpheus && PYTHONPATH=$P:/tmp/wh:/tmp/site timeout $(left) python engine_steps.py --root /tmp/orpheus-ckpt --out "/tmp/es-$V-$i.json" --batches 16,128 --variants orpheus > /tmp/es-$V-$i.log 2>&1)
  python3 -c "import json; d=json.load(open('/tmp/es-$V-$i.json')); print('$V', $i, [(r['batch'], round(r['step_ms_p50'],3), round(r['step_ms_mean'],3), round(r['first_window_ms_p50'])) for r in d['runs']])" || tail -5 /tmp/es-$V-$i.log
done
tar -C /tmp -czf $OUT/es.tgz $(cd /tmp && ls es-*.json)
stamp done
