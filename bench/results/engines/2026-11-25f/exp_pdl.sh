# experiment: qkv trigger position x attention L2 prefetch, step traces at batch 1 and 16
set -u
summ() { python - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for x in d["steps"]:
    att = x["top_us_per_step"].get("_decode_kernel", 0) / 28
    lin = x["top_us_per_step"].get("_linear_kernel", 0) / 84
    print(f"  b{x['batch']} period {x['period_ms_median']:.4f} busy {x['busy_us_per_step']:.0f} gap {x['gap_us_per_step']:.0f} attn {att:.2f} linear {lin:.2f}")
PY
}
i=0
for combo in "1 0" "2 0" "2 1" "1 1" "1 0" "2 1"; do
  set -- $combo; i=$((i+1)); mkdir -p /tmp/o$i
  MSTAR_EXP_QKV_TRIGGER=$1 MSTAR_EXP_ATTN_PREFETCH=$2 TRACE_BATCHES=1,16 bash bench/engines/run_gpu.sh /tmp/o$i trace > /tmp/o$i/log 2>&1
  echo "run $i trigger=$1 prefetch=$2"; summ /tmp/o$i/step_trace.json || tail -20 /tmp/o$i/log
done
