#!/usr/bin/env bash
# Orpheus GPU runs in one device call, from the repository root, with .fi/ and .wheels/ carried:
#   bash bench/orpheus/run_gpu.sh OUTDIR "BENCH_ARGS" [profile,snac,tp]
# BENCH_ARGS go to bench_orpheus.py (e.g. --streams 1,16,64 --baseline-streams ""), once per
# placement in $PLACEMENTS (default "split"; -> OUTDIR/orpheus-<placement>$SUFFIX.json); "profile" also
# py-spies every process at 64 streams (profile_served.py); "snac" runs the SNAC GPU tests and snac_bench.py first.
# "tp" runs bench/engines/tp_bench.py (two GPUs); "steps" engine_steps.py (the engine alone, per
# sampling variant, batches $STEP_BATCHES, more arguments $STEP_ARGS); "tests" the engine's and the SNAC node's GPU tests (-> pytest_gpu.txt);
# "trace" a kernel trace of every process at $TRACE_STREAMS streams (trace_served.py, -> trace$SUFFIX.json).
# BENCH_ARGS "skip" runs no bench.
# Checkpoints are written once; the FlashInfer JIT cache comes back as OUTDIR/fi-jit-cache.tgz.
# .wheels/ (git-ignored) holds the cp312 wheels the GPU image lacks; without googleapis-common-protos the conductor
# cannot start, without snac / einops the SNAC tests error. Rebuild it with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .wheels \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 grpcio==1.85.1 grpcio-health-checking==1.85.1 \
#     grpcio-reflection==1.85.1 grpcio-status==1.85.1 "protobuf>=7.35" googleapis-common-protos aiohttp \
#     aiohappyeyeballs aiosignal frozenlist multidict propcache yarl idna uvloop prometheus-client py-spy snac einops
set -u -o pipefail
OUT=${1:?OUTDIR}; ARGS=${2:-}; STAGES=",${3:-},"
T0=$(date +%s)
mkdir -p /tmp/site && tar -C /tmp/site -xJf .fi/flashinfer-site.tar.xz
mkdir -p ~/.cache && if [ -f .fi/fi-jit-cache.tgz ]; then tar -C ~/.cache -xzf .fi/fi-jit-cache.tgz; fi
mkdir -p /tmp/wh && for w in .wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh; done
chmod +x /tmp/wh/py_spy-*.data/scripts/py-spy; export PATH=$PATH:$(echo /tmp/wh/py_spy-*.data/scripts)
# the checkout itself is the package (mstar/__init__.py maps services/, models/, conductor/, gateway/ into
# it, as pyproject.toml's package-dir does when installed): no install step, no symlinked tree
export PYTHONPATH=$PWD:/tmp/wh:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
save_jit() { tar -C ~/.cache -czf "$OUT/fi-jit-cache.tgz" flashinfer 2>/dev/null; }  # after each stage: a cut-off call keeps it
LIMIT=${LIMIT:-570}  # the device call's limit: the profile gets what is left
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
if [[ $STAGES == *",snac,"* ]]; then
  stamp snac
  snac_tests | tee "$OUT/pytest_snac_gpu${SUFFIX:-}.txt" | tail -n 6
  python -c "from pathlib import Path; from bench_orpheus import SNAC_24K; from mstar.models.orpheus.demo_checkpoint import write_random_snac; write_random_snac(Path('/tmp/snac-ckpt/hubertsiuzdak/snac_24khz'), SNAC_24K)"
  python snac_bench.py --root /tmp/snac-ckpt --out "$OUT/snac_bench${SUFFIX:-}.json" ${SNAC_ARGS:-}
fi
if [[ $STAGES == *",tp,"* ]]; then  # two GPUs: the engine at TP=2 vs TP=1 on the Orpheus LLM checkpoint
  stamp tp
  python -c "from pathlib import Path; from bench_orpheus import write_checkpoints as w; r = Path('/tmp/orpheus-ckpt'); (r / 'hubertsiuzdak').exists() or w(r, tiny=False)"
  (cd "$REPO" && timeout 500 python bench/engines/tp_bench.py --ckpt /tmp/orpheus-ckpt/canopylabs/orpheus-3b-0.1-ft --out "$OUT/tp_bench.json" ${TP_BATCHES:+--batches $TP_BATCHES} 2>&1 | grep -v Warning | tail -40)
fi
if [[ $STAGES == *",steps,"* ]]; then  # the LLM engine alone: step time per sampling variant (engine_steps.py)
  stamp steps
  python engine_steps.py --root /tmp/orpheus-ckpt --out "$OUT/engine_steps${SUFFIX:-}.json" --batches ${STEP_BATCHES:-16,128} ${STEP_ARGS:-} 2>&1 | grep -v Warning
  save_jit
fi
if [[ $STAGES == *",trace,"* ]]; then  # a kernel trace of every process at $TRACE_STREAMS streams (trace_served.py)
  stamp trace
  MSTAR_GPU_TRACE=/tmp/gpu-trace,0.4 PYTHONPATH=$REPO/bench/orpheus/gpu_trace:$PYTHONPATH \
    python trace_served.py --root /tmp/orpheus-ckpt --out "$OUT/trace${SUFFIX:-}.json" --streams ${TRACE_STREAMS:-16} ${TRACE_ARGS:-} 2>&1 | grep -v Warning | tail -60
  save_jit
fi
[[ $ARGS == skip ]] && PLACEMENTS=none
for P in ${PLACEMENTS:-split}; do
  [[ $P == none ]] && continue
  stamp "bench $P"
  eval python bench_orpheus.py --root /tmp/orpheus-ckpt --placement $P --out "$OUT/orpheus-$P${SUFFIX:-}.json" $ARGS
  save_jit
done
if [[ $STAGES == *",profile,"* ]]; then
  stamp profile
  timeout $(( LIMIT - ($(date +%s) - T0) )) python profile_served.py --root /tmp/orpheus-ckpt --out "$OUT/py_spy_${PROFILE_STREAMS:-64}_streams${SUFFIX:-}.txt" --streams ${PROFILE_STREAMS:-64} --max-tokens ${PROFILE_TOKENS:-700} --spy-args="${SPY_ARGS:-}" --model-kwargs="${PROFILE_KWARGS:-{\}}"
fi
save_jit
stamp done
