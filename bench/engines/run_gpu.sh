#!/usr/bin/env bash
# The engine library's GPU runs in one device call, from the repository root, with .fi/ carried:
#   bash bench/engines/run_gpu.sh OUTDIR STAGES    (STAGES: comma-separated, in this order)
#   jit      build FlashInfer's norm / rope / silu_and_mul JIT modules, in parallel (cached: no-op)
#   tests    pytest tests/engines -m gpu                        -> pytest_gpu.txt
#   bench    bench/engines/decode_bench.py (baseline runs skipped past BENCH_DEADLINE; HF_ORDER: which,
#            most wanted first; BENCH_ARGS: more arguments) -> decode_bench.json
# (the parity, GEMM-profile and kernel-trace stages left with their scripts: bench/results/HISTORY.md)
# Packs ~/.cache/flashinfer into OUTDIR/fi-jit-cache.tgz at the end (copy it to .fi/).
set -u -o pipefail
OUT=${1:?OUTDIR}; STAGES=",${2:-jit,tests,bench},"
T0=$(date +%s)
mkdir -p /tmp/site && tar -C /tmp/site -xJf .fi/flashinfer-site.tar.xz
mkdir -p ~/.cache && if [ -f .fi/fi-jit-cache.tgz ]; then tar -C ~/.cache -xzf .fi/fi-jit-cache.tgz; fi
# the checkout itself is the package (mstar/__init__.py maps services/, models/, conductor/, gateway/ into
# it, as pyproject.toml's package-dir does when installed): no install step, no symlinked tree
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
has() { [[ $STAGES == *",$1,"* ]]; }
if has jit; then
  stamp "jit start"
  for m in "norm import gen_norm_module as g; g()" "rope import gen_rope_module as g; g()" \
           "activation import gen_act_and_mul_module as g; g('silu')"; do
    python -c "from flashinfer.jit.$m.build_and_load()" > "/tmp/jit_${m%% *}.log" 2>&1 &
  done
fi
if has jit; then wait; stamp "jit done"; tail -n 3 /tmp/jit_*.log; fi
if has tests; then
  stamp tests
  # from tests/engines, as before (the checkout on PYTHONPATH serves the package either way)
  (cd tests/engines && python -m pytest . -m gpu -q -o addopts="" -p no:cacheprovider 2>&1) \
    | tee "$OUT/pytest_gpu.txt" | tail -n 15
fi
if has bench; then
  stamp bench
  python bench/engines/decode_bench.py --out "$OUT/decode_bench.json" --deadline "${BENCH_DEADLINE:-$(( T0 + 540 ))}" \
    --hf-order "${HF_ORDER:-16,64,1,8,32}" ${BENCH_ARGS:-}
fi
stamp "pack"
tar -C ~/.cache -czf "$OUT/fi-jit-cache.tgz" flashinfer
stamp done
