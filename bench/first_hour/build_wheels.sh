#!/usr/bin/env bash
# The wheel folder a GPU host with no package index needs for `make setup EXTRAS=$EXTRAS` (Python 3.12,
# x86_64): this package's run-time closure for those extras, FlashInfer's three wheels and their small
# runtime needs, setuptools for the editable build. torch, triton and the NVIDIA libraries are left out
# (the host's CUDA torch is kept); `snac` (the tests' reference, dev only) comes without its torch pin.
# Run it on a machine with an index, from the repository root:
#   bash bench/first_hour/build_wheels.sh .wheels-first-hour [EXTRAS, default orpheus]
# (59 wheels, 124 MB for orpheus; FlashInfer alone is 62 MB). To carry it in a device call (64 MiB), pack it:
#   SLIM=1 PACK=.fi/first-hour-wheels.tar.xz bash bench/first_hour/build_wheels.sh /tmp/wheels
# SLIM=1 leaves out numpy and transformers (the GPU image has them, GPU.md); PACK re-stores every wheel
# uncompressed and xz-compresses the folder (FlashInfer's sources shrink 4x); gpu_first_hour.sh unpacks it.
set -euo pipefail
OUT=${1:?WHEEL_DIR}; EXTRAS=${2:-orpheus}
mkdir -p "$OUT"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
          --platform manylinux1_x86_64)
EXTRAS=$EXTRAS python3 - > "$OUT/requirements.txt" <<'PY'
import os, re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
todo, reqs, seen = os.environ["EXTRAS"].split(","), list(project["dependencies"]), set()
while todo:  # extras may name others: mstar[all] -> orpheus, envoy
    e = todo.pop()
    if e in seen:
        continue
    seen.add(e)
    for r in extras[e]:
        m = re.fullmatch(r"mstar\[(.+)\]", r.replace(" ", ""))
        todo += m.group(1).split(",") if m else []
        reqs += [] if m else [r]
skip = re.compile(r"^(torch|triton|snac)\b")  # the host's CUDA torch (and triton) stay; snac comes --no-deps
print("\n".join(sorted(set(r for r in reqs if not skip.match(r)))))
PY
python3 -m pip download -q -d "$OUT" "${PLATFORM[@]}" -r "$OUT/requirements.txt" "setuptools>=68" wheel \
  $(make -s print-FLASHINFER_RUNTIME)
python3 -m pip download -q -d "$OUT" "${PLATFORM[@]}" --no-deps snac $(make -s print-FLASHINFER)
rm -f "$OUT"/torch-* "$OUT"/triton-*
for f in "$OUT"/nvidia_*; do case $f in *nvidia_ml_py*|*'nvidia_*') ;; *) rm -f "$f";; esac; done  # CUDA libs: the host's
[ "${SLIM:-0}" = 1 ] && rm -f "$OUT"/numpy-* "$OUT"/transformers-*
echo "$(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT"
if [ -n "${PACK:-}" ]; then
  stored=$(mktemp -d); trap 'rm -rf "$stored"' EXIT
  python3 - "$OUT" "$stored" <<'PY'
import copy, sys, zipfile
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for wheel in src.glob("*.whl"):  # same files, stored: xz then compresses across them
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dst / wheel.name, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data, stored = zin.read(info), copy.copy(info)  # zin keeps reading through its own infos
            stored.compress_type = zipfile.ZIP_STORED
            zout.writestr(stored, data)
PY
  mkdir -p "$(dirname "$PACK")"
  tar -C "$stored" -cf - . | xz -T0 -6 > "$PACK"
  echo "packed into $PACK ($(du -sh "$PACK" | cut -f1))"
fi
