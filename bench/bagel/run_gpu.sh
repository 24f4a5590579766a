#!/usr/bin/env bash
# BAGEL's GPU runs (issues 31 and 33) in one device call, from the repository root, with .gpuwheels/
# and .ref/ carried (both git-ignored):
#   bash bench/bagel/run_gpu.sh OUTDIR [full|smoke|layouts]
# layouts (issue 33): text-to-image 1024² and editing through the mesh, the one-device layout on the last GPU
#   and LAYOUTS (default: three_gpus_sp two_gpus_sp three_gpus) on the first three, then the ratios
#   (layouts.json; the images stay on the host); after the one-device layout, ours in one process and
#   the FLOP floor on its GPU (pipeline.json). .fi/flashinfer-site.tar.xz and .fi/fi-jit-cache.tgz, when
#   carried, give every mode FlashInfer's attention.
# .gpuwheels/: the cp312 wheels the GPU image lacks (bench/orpheus/run_gpu.sh's list without py-spy and
#   snac, plus pydantic, pydantic-core, annotated-types, typing-inspection, pillow).
# .ref/bagel: the public reference tree as published (github.com/ByteDance-Seed/Bagel; only read, never
#   vendored): `git -C MIRROR archive HEAD inferencer.py modeling data | tar -x -C .ref/bagel` (056b5fd). Not
#   the tests' copy, whose bf16 casts are removed for fp32 (tests/bagel/data/README.md): in bf16 that one
#   writes fp32 keys into its bf16 cache;
# .ref/wheels: transformers 4.49.0, tokenizers 0.21.4, huggingface-hub 0.36.2, einops 0.8.2, accelerate 1.6.0,
#   psutil — the reference is written for transformers 4.49 (and loads through accelerate's dispatch), so it
#   runs in its own process with those first on the path.
# LIMIT (default 560): seconds from the start by which every bench process is stopped; REPS (default 2): timed repetitions after one warm-up; SIZES (default "1024 512"): text-to-image sizes;
# PARTS (default "pipeline served"; none: the reference alone): ours on the one GPU before the reference.
# Writes the full-size random checkpoint once, then at once: on the last GPU the one-GPU bench (ours as a
# pipeline and served, then the reference), on the first three (or two) the CFG layouts through the
# launcher's mesh (one, two, three devices). "smoke": the same with the tiny checkpoint on CUDA.
set -u -o pipefail
OUT=${1:?OUTDIR}; MODE=${2:-full}
T0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
mkdir -p /tmp/wh /tmp/ref
for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh; done
for w in .ref/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/ref; done
# the checkout itself is the package (mstar/__init__.py maps the top-level folders into it)
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
if [ -f .fi/flashinfer-site.tar.xz ]; then  # FlashInfer's attention (else torch SDPA over gathered pages)
  mkdir -p /tmp/site ~/.cache && tar -C /tmp/site -xJf .fi/flashinfer-site.tar.xz && export PYTHONPATH=$PYTHONPATH:/tmp/site
  if [ -f .fi/fi-jit-cache.tgz ]; then tar -C ~/.cache -xzf .fi/fi-jit-cache.tgz; fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
full_checkpoint() {  # the full-size random checkpoint, written once per host
  [ -f $CK/ema.safetensors ] || python3 -c "from mstar.models.bagel.demo import write_full_checkpoint as w; w('$CK', 'cuda')"
}
N=$(nvidia-smi -L | wc -l); LAST=$((N - 1)); MULTI=$(seq -s, 0 $(( N > 3 ? 2 : N - 2 )))
if [ "$MODE" = layouts ]; then  # issue 33: the one-device layout on the last GPU beside the others on the first three
  CK=/tmp/bagel-full; full_checkpoint
  stamp "checkpoint"
  ARGS=(--ckpt $CK --reps ${REPS:-1} --sizes 1024 --parts multi_gpu); TO=$(( ${LIMIT:-560} - $(date +%s) + T0 ))
  W=/tmp/bagel-layouts; mkdir -p $W  # the images stay on the host (a call brings back 8 files)
  ( CUDA_VISIBLE_DEVICES=$LAST timeout $TO python3 bench/bagel/bench_bagel.py "${ARGS[@]}" --layouts one_gpu \
      --out $W/layouts_one.json
    # then ours in one process and the FLOP floor (issue 31), on the same GPU
    CUDA_VISIBLE_DEVICES=$LAST timeout $(( ${LIMIT:-560} - $(date +%s) + T0 )) python3 bench/bagel/bench_bagel.py \
      --ckpt $CK --reps 1 --sizes 1024 --parts pipeline --out "$OUT/pipeline.json" ) > "$OUT/layouts_one_log.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=$MULTI timeout $TO python3 bench/bagel/bench_bagel.py "${ARGS[@]}" \
    --layouts ${LAYOUTS:-three_gpus_sp two_gpus_sp three_gpus} --out $W/layouts_multi.json > "$OUT/layouts_multi_log.txt" 2>&1
  wait
  stamp "layouts"
  cp $W/*.json "$OUT/"
  python3 bench/bagel/bench_bagel.py --parts compare --records $W/layouts_one.json $W/layouts_multi.json \
    --out $W/layouts.json && cp $W/layouts.json "$OUT/"
  tar -C ~/.cache -czf "$OUT/fi-jit-cache.tgz" flashinfer 2>/dev/null
  tail -n 5 "$OUT"/*_log.txt
  exit 0
fi
if [ "$MODE" = smoke ]; then
  CK=/tmp/bagel-tiny
  [ -f $CK/ema.safetensors ] || python3 -c "from mstar.models.bagel.demo import write_checkpoint as w; w('$CK')"
  ARGS=(--device cuda --tiny --ckpt $CK); TO=150
else
  CK=/tmp/bagel-full; full_checkpoint
  stamp "checkpoint"
  ARGS=(--ckpt $CK --reps ${REPS:-2} --sizes ${SIZES:-1024 512}); TO=$(( ${LIMIT:-560} - $(date +%s) + T0 ))
fi
( if [ "${PARTS:-}" != none ]; then
    CUDA_VISIBLE_DEVICES=$LAST timeout $TO python3 bench/bagel/bench_bagel.py "${ARGS[@]}" --parts ${PARTS:-pipeline served} \
      --out "$OUT/bagel_1gpu.json"; stamp "ours on one GPU"
  fi
  CUDA_VISIBLE_DEVICES=$LAST PYTHONPATH=/tmp/ref:$PYTHONPATH timeout $(( ${LIMIT:-560} + 10 - $(date +%s) + T0 )) python3 \
    bench/bagel/bench_bagel.py "${ARGS[@]}" --parts reference --reference .ref/bagel --out "$OUT/bagel_reference.json"
  stamp "reference" ) > "$OUT/bagel_1gpu_log.txt" 2>&1 &
if [ "$N" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=$MULTI timeout $TO python3 bench/bagel/bench_bagel.py "${ARGS[@]}" --parts multi_gpu \
    --out "$OUT/bagel_multi_gpu.json" > "$OUT/bagel_multi_log.txt" 2>&1
  stamp "multi-GPU layouts"
fi
wait
stamp "done"
tail -n 5 "$OUT"/*_log.txt
