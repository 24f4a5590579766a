#!/usr/bin/env bash
# GPU tests on the working tree, then step traces (batch 16) of old (HEAD) and new.
set -u -o pipefail
OUT=$1
T0=$(date +%s)
mkdir -p /tmp/site && tar -C /tmp/site -xJf .fi/flashinfer-site.tar.xz
mkdir -p ~/.cache && tar -C ~/.cache -xzf .fi/fi-jit-cache.tgz
R=/tmp/res && mkdir -p $R /tmp/arms/old /tmp/arms/new
cp -r .ab/old/services /tmp/arms/old/ && cp -r services /tmp/arms/new/
for a in old new; do
  mkdir -p /tmp/pkg_$a/mstar && for f in mstar/*; do ln -sfn "$PWD/$f" /tmp/pkg_$a/mstar/; done
  for d in models conductor gateway; do ln -sfn "$PWD/$d" /tmp/pkg_$a/mstar/$d; done
  ln -sfn /tmp/arms/$a/services /tmp/pkg_$a/mstar/services
done
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpu.txt"
(cd tests/engines && PYTHONPATH=/tmp/pkg_new:/tmp/site python -m pytest . -m gpu -q -o addopts="" -p no:cacheprovider 2>&1) \
  > "$R/pytest_gpu.txt"; tail -n 3 "$R/pytest_gpu.txt"
(cd tests/engines && PYTHONPATH=/tmp/pkg_new:/tmp/site python -m pytest test_sample_triton.py -q -o addopts="" -p no:cacheprovider 2>&1; \
 cd ../orpheus && PYTHONPATH=/tmp/pkg_new:/tmp/site python -m pytest test_orpheus_snac.py -m gpu -q -o addopts="" -p no:cacheprovider 2>&1) \
  > "$R/pytest_gpu_more.txt"; grep -E "passed|failed|error" "$R/pytest_gpu_more.txt"
echo "== tests done at $(( $(date +%s) - T0 )) s"
for r in 1 2; do for a in old new; do
  (cd bench/engines && PYTHONPATH=/tmp/pkg_$a:/tmp/site python step_trace.py --out "$R/step_trace-$a-$r.json" --batches 16 2>&1 | grep -v Warning | tail -n 2)
done; done
python - $R <<'PY'
import json, sys
for a in ("old", "new"):
    for r in (1, 2):
        s = json.load(open(f"{sys.argv[1]}/step_trace-{a}-{r}.json"))["steps"][0]
        print(a, r, "period", round(s["period_ms_median"], 4), "gap/step", round(s["gap_us_per_step"], 1),
              "kernels/step", round(s["kernels_per_step"], 1))
        print("   gaps", {k: v for k, v in s["gap_us_per_step_by_pair"].items() if v >= 1})
PY
tar -C $R -czf "$OUT/res.tgz" .
echo "== done at $(( $(date +%s) - T0 )) s"
