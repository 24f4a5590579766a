#!/usr/bin/env bash
# Orpheus GPU runs in one device call, from the repository root, with .fi/ and .wheels/ carried:
#   bash bench/orpheus/run_gpu.sh OUTDIR "BENCH_ARGS" [tests,tp]
# BENCH_ARGS go to bench_orpheus.py (e.g. --streams 1,16,64 --baseline-streams ""), once per
# placement in $PLACEMENTS (default "split"; -> OUTDIR/orpheus-<placement>$SUFFIX.json). "tests" runs the
# engine's, the fused sampler's and the SNAC node's GPU tests (-> pytest_gpu.txt); "tp" runs
# bench/engines/tp_bench.py (two GPUs). BENCH_ARGS "skip" runs no bench. (The profile, SNAC micro-benchmark,
# engine-steps and kernel-trace stages left with their scripts: bench/results/HISTORY.md.)
# Checkpoints are written once; the FlashInfer JIT cache comes back as OUTDIR/fi-jit-cache.tgz.
# .wheels/ (git-ignored) holds the cp312 wheels the GPU image lacks; without googleapis-common-protos the conductor
# cannot start, without snac / einops the SNAC tests error. Rebuild it with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .wheels \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 grpcio==1.85.1 grpcio-health-checking==1.85.1 \
#     grpcio-reflection==1.85.1 grpcio-status==1.85.1 "protobuf>=7.35" googleapis-common-protos aiohttp \
#     aiohappyeyeballs aiosignal frozenlist multidict propcache yarl idna uvloop prometheus-client snac einops
set -u -o pipefail
OUT=${1:?OUTDIR}; ARGS=${2:-}; STAGES=",${3:-},"
T0=$(date +%s)
mkdir -p /tmp/site && tar -C /tmp/site -xJf .fi/flashinfer-site.tar.xz
mkdir -p ~/.cache && if [ -f .fi/fi-jit-cache.tgz ]; then tar -C ~/.cache -xzf .fi/fi-jit-cache.tgz; fi
mkdir -p /tmp/wh && for w in .wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh; done
# the checkout itself is the package (mstar/__init__.py maps services/, models/, conductor/, gateway/ into
# it, as pyproject.toml's package-dir does when installed): no install step, no symlinked tree
export PYTHONPATH=$PWD:/tmp/wh:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
save_jit() { tar -C ~/.cache -czf "$OUT/fi-jit-cache.tgz" flashinfer 2>/dev/null; }  # after each stage: a cut-off call keeps it
REPO=$PWD
snac_tests() {  # the SNAC node's GPU tests and the fused SNAC decode's tests on CUDA
  (cd "$REPO/tests/orpheus" && python -m pytest test_orpheus_snac.py -m gpu -q -o addopts="" -p no:cacheprovider 2>&1 && \
   python -m pytest test_snac_triton.py -q -o addopts="" -p no:cacheprovider 2>&1)
}
if [[ $STAGES == *",tests,"* ]]; then  # the engine's GPU tests and the fused sampler's tests on CUDA
  stamp tests
  (cd tests/engines && python -m pytest . -m gpu -q -o addopts="" -p no:cacheprovider 2>&1 && \
   python -m pytest test_sample_triton.py -q -o addopts="" -p no:cacheprovider 2>&1 && snac_tests) | tee "$OUT/pytest_gpu.txt" | tail -n 12
fi
cd bench/orpheus
if [[ $STAGES == *",tp,"* ]]; then  # two GPUs: the engine at TP=2 vs TP=1 on the Orpheus LLM checkpoint
  stamp tp
  python -c "from pathlib import Path; from bench_orpheus import write_checkpoints as w; r = Path('/tmp/orpheus-ckpt'); (r / 'hubertsiuzdak').exists() or w(r, tiny=False)"
  (cd "$REPO" && timeout 500 python bench/engines/tp_bench.py --ckpt /tmp/orpheus-ckpt/canopylabs/orpheus-3b-0.1-ft --out "$OUT/tp_bench.json" ${TP_BATCHES:+--batches $TP_BATCHES} 2>&1 | grep -v Warning | tail -40)
fi
[[ $ARGS == skip ]] && PLACEMENTS=none
for P in ${PLACEMENTS:-split}; do
  [[ $P == none ]] && continue
  stamp "bench $P"
  eval python bench_orpheus.py --root /tmp/orpheus-ckpt --placement $P --out "$OUT/orpheus-$P${SUFFIX:-}.json" $ARGS
  save_jit
done
save_jit
stamp done
