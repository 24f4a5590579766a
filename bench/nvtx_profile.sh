#!/usr/bin/env bash
# Issue 36: one served request profiled with its NVTX ranges, in one device call from the repository
# root with .gpuwheels/ carried (see bench/bagel/run_gpu.sh):
#   bash bench/nvtx_profile.sh OUTDIR [MODEL]        (MODEL: orpheus, default, with --random-weights)
# `mstar serve MODEL --random-weights --enable-nvtx --gpus 0` runs under Nsight Systems (`nsys`, which
# follows the launcher's service processes); one /v1/audio/speech request (or /generate for another
# model); the mesh stops; `nsys stats` writes the NVTX range summary to OUTDIR/nvtx_summary.txt and the
# CUDA kernel summary to OUTDIR/cuda_kernels.txt. Where the host has no nsys, OUTDIR/nvtx_summary.txt
# says so, and the same request is served with --enable-nvtx without a profiler (the ranges' CUDA path
# runs; nothing records them): OUTDIR/serve_log.txt, and the times to ready and to the first byte in
# OUTDIR/request.txt.
set -u -o pipefail
OUT=${1:?OUTDIR}; MODEL=${2:-orpheus}
mkdir -p /tmp/wh && for w in .gpuwheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wh; done
export PYTHONPATH=$PWD:/tmp/wh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
PORT=18000
SERVE=(python3 -m mstar.cli serve "$MODEL" --random-weights --enable-nvtx --gpus 0 --port $PORT --grpc-port 0)
if [ -z "$NSYS" ]; then
  echo "no Nsight Systems (nsys) on this host: $(uname -a); served with --enable-nvtx, no profiler (serve_log.txt)" \
    > "$OUT/nvtx_summary.txt"
  "${SERVE[@]}" > "$OUT/serve_log.txt" 2>&1 &
else
  "$NSYS" --version >> "$OUT/gpu.txt"
  "$NSYS" profile -t cuda,nvtx,osrt --trace-fork-before-exec=true -o /tmp/mstar-nvtx --force-overwrite true \
    "${SERVE[@]}" > "$OUT/serve_log.txt" 2>&1 &
fi
PROF=$!
T0=$(date +%s)
for _ in $(seq 240); do grep -q "M\* ready" "$OUT/serve_log.txt" && break; sleep 1; done
echo "ready after $(( $(date +%s) - T0 )) s" > "$OUT/request.txt"
python3 - "$MODEL" "$PORT" >> "$OUT/request.txt" 2>&1 <<'PY'
import json, sys, time, urllib.request
model, port = sys.argv[1], sys.argv[2]
path, body = ("/v1/audio/speech", {"model": model, "input": "Hello there, this is one profiled request.", "voice": "tara"}) \
    if model == "orpheus" else ("/generate", {"model": model, "text": "hello"})
req = urllib.request.Request(f"http://localhost:{port}{path}", json.dumps(body).encode(), {"content-type": "application/json"})
t0 = time.perf_counter()
with urllib.request.urlopen(req, timeout=120) as r:
    first = r.read(1)
    t1 = time.perf_counter()
    n = len(first) + len(r.read())
print(f"request {path}: HTTP {r.status}, first byte {t1 - t0:.3f} s, {n} bytes in {time.perf_counter() - t0:.3f} s")
PY
pkill -INT -f "mstar.cli serve $MODEL" ; wait $PROF
echo "serve's exit status: $?" >> "$OUT/request.txt"
[ -z "$NSYS" ] && { cat "$OUT/request.txt"; exit 0; }
"$NSYS" stats -r nvtx_sum /tmp/mstar-nvtx.nsys-rep > "$OUT/nvtx_summary.txt" 2>&1
"$NSYS" stats -r cuda_gpu_kern_sum /tmp/mstar-nvtx.nsys-rep | head -40 > "$OUT/cuda_kernels.txt" 2>&1
tail -n 30 "$OUT/nvtx_summary.txt"
