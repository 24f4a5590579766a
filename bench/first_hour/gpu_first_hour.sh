#!/usr/bin/env bash
# Issue 35's "Done when", on a GPU host with a CUDA torch preinstalled and no package index. From the
# repository root, with the wheel folder of bench/first_hour/build_wheels.sh:
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.wheels-first-hour bash bench/first_hour/gpu_first_hour.sh OUTDIR
# or with its packed form (carried as .fi/first-hour-wheels.tar.xz), which this script unpacks and points
# PIP_FIND_LINKS at (PIP_NO_INDEX=1 set too):
#   bash bench/first_hour/gpu_first_hour.sh OUTDIR
# 1. a fresh clone of this checkout (its committed HEAD; a copy of the tree where there is no .git);
# 2. `make setup EXTRAS=orpheus` in a virtual environment that sees the system's packages (so the
#    preinstalled CUDA torch is kept): timed, log in OUTDIR/setup.log;
# 3. a full-size random Orpheus checkpoint in the Hugging Face hub layout (write_hub_checkpoint.py);
# 4. `mstar serve orpheus --cache-dir DIR`, nothing else: time to ready, then /v1/audio/speech
#    (pcm, wav, pcm again): time to first audio byte (first_audio.py).
# Everything lands in OUTDIR/first_hour.json (and the logs beside it).
set -euo pipefail
OUT=$(realpath -m "${1:?OUTDIR}"); mkdir -p "$OUT"
SRC=$PWD; WORK=${WORK:-/tmp/first-hour}
rm -rf "$WORK"; mkdir -p "$WORK"
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
T0=$(date +%s)
if [ -z "${PIP_FIND_LINKS:-}" ] && [ -f .fi/first-hour-wheels.tar.xz ]; then
  mkdir -p "$WORK/wheels" && tar -C "$WORK/wheels" -xJf .fi/first-hour-wheels.tar.xz
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WORK/wheels"
fi
echo "pip: PIP_NO_INDEX=${PIP_NO_INDEX:-} PIP_FIND_LINKS=${PIP_FIND_LINKS:-}"
if git -C "$SRC" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git clone -q "$SRC" "$WORK/mstar"; how="git clone of $(git -C "$SRC" rev-parse --short HEAD)"
else
  mkdir -p "$WORK/mstar"
  tar -C "$SRC" --exclude=./.git --exclude=./.fi --exclude='./.wheels*' --exclude='*.egg-info' \
      --exclude=__pycache__ -cf - . | tar -C "$WORK/mstar" -xf -; how="copy of the tree (no .git here)"
fi
if python3 -c "import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)"; then
  # the image's python is already a virtual environment (its CUDA torch lives there): install into it,
  # as a user of that image would; a venv on top would not see its packages
  echo "python3 is the virtual environment $(python3 -c 'import sys; print(sys.prefix)'): setup installs into it"
  mkdir -p "$WORK/venv/bin" && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > "$WORK/venv/bin/python"
  chmod +x "$WORK/venv/bin/python"
else
  python3 -m venv --system-site-packages "$WORK/venv"
fi
export PATH="$WORK/venv/bin:$PATH" PYTHONUNBUFFERED=1
cd "$WORK/mstar"
stamp "make setup ($how)"
S0=$(date +%s.%N)
set +e; make setup PYTHON=python EXTRAS=orpheus SYSTEM_PACKAGES=no > "$OUT/setup.log" 2>&1; SETUP_RC=$?; set -e
SETUP_S=$(python -c "import time; print(round(time.time() - $S0, 1))")
tail -n 8 "$OUT/setup.log"
[ $SETUP_RC = 0 ] || { echo "make setup failed ($SETUP_RC): $OUT/setup.log"; exit 1; }
python -c "import json, torch, flashinfer; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, \
'flashinfer': flashinfer.__version__, 'gpus': torch.cuda.device_count()}))" > "$OUT/versions.json"
stamp "checkpoint"
python bench/first_hour/write_hub_checkpoint.py "$WORK/hub" > "$OUT/checkpoint.json"
stamp "serve"
cd "$WORK"  # not the checkout: the installed package serves
python "$WORK/mstar/bench/first_hour/first_audio.py" --cache-dir "$WORK/hub" --out "$OUT/first_audio.json" > /dev/null
python - "$OUT" "$SETUP_S" "$how" <<'PY'
import json, sys
from pathlib import Path
out, setup_s, how = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
record = {"source": how, "make_setup_s": setup_s, **json.loads((out / "versions.json").read_text()),
          "checkpoint": json.loads((out / "checkpoint.json").read_text()),
          **json.loads((out / "first_audio.json").read_text())}
(out / "first_hour.json").write_text(json.dumps(record, indent=2) + "\n")
print(json.dumps({k: record[k] for k in ("device", "torch", "flashinfer", "make_setup_s", "ready_s", "flashinfer_used",
                                         "cuda_graphs_used")}, indent=2))
print("first audio:", [(r["format"], r["first_byte_s"], r["audio_s"]) for r in record["requests"]])
PY
stamp done
