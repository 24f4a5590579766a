#!/usr/bin/env bash
# One-off A/B (not committed): the sampler's UploadRing (working tree) vs dc1c9d5 (ab_base/*.py)
set -u -o pipefail
OUT=${1:?OUT}; T0=$(date +%s); DL=${DL:-530}
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
mkdir -p /tmp/site && tar -C /tmp/site -xJf .fi/flashinfer-site.tar.xz
mkdir -p ~/.cache && if [ -f .fi/fi-jit-cache.tgz ]; then tar -C ~/.cache -xzf .fi/fi-jit-cache.tgz; fi
mkdir -p /tmp/wh && for w in .wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh; done
REPO=$PWD
mk() {  # $1 pkg dir, $2 services dir
  mkdir -p $1/mstar && for f in mstar/*; do ln -sfn "$REPO/$f" $1/mstar/; done
  for d in models conductor gateway; do ln -sfn "$REPO/$d" $1/mstar/$d; done
  ln -sfn $2 $1/mstar/services
}
cp -r services /tmp/base_services && cp ab_base/batch.py ab_base/cuda_graphs.py ab_base/kv_engine.py ab_base/sampling.py /tmp/base_services/engines/
mk /tmp/pkg "$REPO/services"; mk /tmp/pkgb /tmp/base_services
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
save_jit() { tar -C ~/.cache -czf "$OUT/fi-jit-cache.tgz" flashinfer 2>/dev/null; }
for m in "norm import gen_norm_module as g; g()" "rope import gen_rope_module as g; g()" "activation import gen_act_and_mul_module as g; g('silu')"; do
  PYTHONPATH=/tmp/pkg:/tmp/wh:/tmp/site python -c "from flashinfer.jit.$m.build_and_load()" > /dev/null 2>&1 &
done
stamp ckpt
(cd bench/orpheus && PYTHONPATH=/tmp/pkg:/tmp/wh:/tmp/site python -c "from pathlib import Path; from bench_orpheus import write_checkpoints as w; w(Path('/tmp/orpheus-ckpt'), tiny=False)" 2>&1 | grep -v Warning | tail -3)
wait; stamp jit-done; save_jit
i=0
for V in side base side base; do
  i=$((i+1)); [ $(left) -lt 60 ] && break
  P=/tmp/pkg; [ $V = base ] && P=/tmp/pkgb
  stamp "steps $V $i"
  (cd bench/orpheus && PYTHONPATH=$P:/tmp/wh:/tmp/site timeout $(left) python engine_steps.py --root /tmp/orpheus-ckpt --out "$OUT/es-$V-$i.json" --batches 16,64,128 --variants orpheus 2>&1 | grep -v Warning | grep -E '"batch"|Error|error' | cut -c1-300)
  save_jit
done
if [ $(left) -gt 70 ]; then stamp tests
  (cd tests/engines && PYTHONPATH=/tmp/pkg:/tmp/wh:/tmp/site timeout $(left) python -m pytest . -m gpu -q -o addopts="" -p no:cacheprovider 2>&1 && PYTHONPATH=/tmp/pkg:/tmp/wh:/tmp/site python -m pytest test_sample_triton.py -q -o addopts="" -p no:cacheprovider 2>&1) > "$OUT/pytest_gpu.txt"; tail -n 4 "$OUT/pytest_gpu.txt"
fi
save_jit; stamp done
