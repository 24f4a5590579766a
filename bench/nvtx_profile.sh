#!/usr/bin/env bash
# Issue 36: one served request profiled with its NVTX ranges, in one device call from the repository
# root with .gpuwheels/ carried (see bench/bagel/run_gpu.sh):
#   bash bench/nvtx_profile.sh OUTDIR [MODEL]        (MODEL: orpheus, default, with --random-weights)
# `mstar serve MODEL --random-weights --enable-nvtx --gpus 0` runs under Nsight Systems (`nsys`, which
# follows the launcher's service processes); one /v1/audio/speech request (or /generate for another
# model); the mesh stops; `nsys stats` writes the NVTX range summary to OUTDIR/nvtx_summary.txt and the
# CUDA kernel summary to OUTDIR/cuda_kernels.txt. Where the host has no nsys, OUTDIR/nvtx_summary.txt
# says so and nothing else runs.
set -u -o pipefail
OUT=${1:?OUTDIR}; MODEL=${2:-orpheus}
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
if [ -z "$NSYS" ]; then
  echo "no Nsight Systems (nsys) on this host: $(uname -a)" > "$OUT/nvtx_summary.txt"; exit 0
fi
"$NSYS" --version >> "$OUT/gpu.txt"
PORT=18000
"$NSYS" profile -t cuda,nvtx,osrt --trace-fork-before-exec=true -o /tmp/mstar-nvtx --force-overwrite true \
  python3 -m mstar.cli serve "$MODEL" --random-weights --enable-nvtx --gpus 0 --port $PORT --grpc-port 0 \
  > "$OUT/serve_log.txt" 2>&1 &
PROF=$!
for _ in $(seq 240); do grep -q "M\* ready" "$OUT/serve_log.txt" && break; sleep 1; done
if [ "$MODEL" = orpheus ]; then
  curl -s -m 120 "localhost:$PORT/v1/audio/speech" -H 'content-type: application/json' \
    -d '{"model": "orpheus", "input": "Hello there, this is one profiled request.", "voice": "tara"}' -o /tmp/one.wav
  echo "audio bytes: $(stat -c %s /tmp/one.wav)" >> "$OUT/serve_log.txt"
else
  curl -s -m 120 "localhost:$PORT/generate" -H 'content-type: application/json' \
    -d "{\"model\": \"$MODEL\", \"text\": \"hello\"}" >> "$OUT/serve_log.txt"
fi
pkill -INT -f "mstar.cli serve $MODEL" ; wait $PROF
"$NSYS" stats -r nvtx_sum /tmp/mstar-nvtx.nsys-rep > "$OUT/nvtx_summary.txt" 2>&1
"$NSYS" stats -r cuda_gpu_kern_sum /tmp/mstar-nvtx.nsys-rep | head -40 > "$OUT/cuda_kernels.txt" 2>&1
tail -n 30 "$OUT/nvtx_summary.txt"
