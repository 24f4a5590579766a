"""FlashInfer attention backend vs the pure-torch paged reference on random paged inputs (GPU).

bf16 inputs; the reference runs the torch backend on the same cache cast to fp32. Passes when
every case has max |err| <= 2e-2 and relative error ||err|| / ||ref|| <= 1e-2.

    python bench/engines/flashinfer_parity.py --out flashinfer_parity.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mstar.services.engines.attention import AttentionBatch, HeadShape, TorchPagedAttention
from mstar.services.engines.attn_flashinfer import WORKSPACE_BYTES, FlashInferAttention, FlashInferGraphDecode
from mstar.services.engines.pages import build_csr, pages_for

MAX_ABS, MAX_REL = 2e-2, 1e-2
HEADS = HeadShape(24, 8, 128)  # Llama-3.2-3B's attention, so the decode benchmark reuses the JIT kernels
PAGE = 16
NUM_PAGES = 2048

# (name, q_lens, kv_lens incl. the new tokens, causal, graph batch size or None)
CASES = [
    ("decode_b16", [1] * 16, [1, 7, 16, 17, 64, 100, 129, 255, 256, 257, 300, 511, 512, 600, 33, 2], True, None),
    ("prefill_causal_with_prefix", [1, 17, 64, 200], [1, 50, 164, 207], True, None),
    ("prefill_causal_fresh", [2048], [2048], True, None),
    ("attend_without_append_noncausal", [5, 16, 64], [45, 16, 300], False, None),
    ("graph_decode_b5_in_bucket8", [1] * 5, [3, 16, 40, 129, 300], True, 8),
]


def run_case(name, q_lens, kv_lens, causal, graph_bs, k_cache, v_cache, workspace, gen):
    dev = k_cache.device
    perm = torch.randperm(NUM_PAGES - 1, generator=gen).add(1).tolist()  # scattered pages, page 0 spare
    page_lists = [[perm.pop() for _ in range(pages_for(n, PAGE))] for n in kv_lens]
    q = torch.randn(sum(q_lens), HEADS.num_qo_heads, HEADS.head_dim, generator=gen).to(dev, torch.bfloat16)
    pad = (graph_bs - len(q_lens)) if graph_bs else 0
    table = build_csr(page_lists + [[0]] * pad, list(kv_lens) + [1] * pad, PAGE)
    qo = torch.tensor([0, *torch.tensor(q_lens + [1] * pad).cumsum(0).tolist()], dtype=torch.int32)
    batch = AttentionBatch(qo, table, torch.zeros(int(qo[-1]), dtype=torch.long), causal)
    if graph_bs:
        fi = FlashInferGraphDecode(HEADS, dev, torch.bfloat16, PAGE, graph_bs, NUM_PAGES, workspace)
        q_run = torch.cat([q, q.new_zeros(pad, *q.shape[1:])])
    else:
        fi = FlashInferAttention(HEADS, dev, torch.bfloat16, PAGE)
        q_run = q
    t0 = time.perf_counter()
    fi.plan(batch)
    out = fi.run(q_run, k_cache, v_cache)[: q.shape[0]].float()
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0  # includes any JIT compile
    ref_batch = AttentionBatch(
        qo[: len(q_lens) + 1], build_csr(page_lists, kv_lens, PAGE), batch.slots[: q.shape[0]], causal
    )
    ref = TorchPagedAttention(HEADS, dev)
    ref.plan(ref_batch)
    want = ref.run(q.float(), k_cache.float(), v_cache.float())
    err = (out - want).abs()
    rel = (err.norm() / want.norm()).item()
    return {
        "case": name, "q_lens": q_lens, "kv_lens": kv_lens, "causal": causal, "graph_batch": graph_bs,
        "max_abs_err": err.max().item(), "rel_err": rel, "first_call_s": round(first_call_s, 3),
        "ok": bool(err.max().item() <= MAX_ABS and rel <= MAX_REL),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import flashinfer

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_PAGES, PAGE, HEADS.num_kv_heads, HEADS.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dev, torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(dev, torch.bfloat16)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    results = []
    for case in CASES:
        results.append(run_case(*case, k_cache, v_cache, workspace, gen))
        print(json.dumps(results[-1]), flush=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flashinfer": flashinfer.__version__,
        "dtype": "bfloat16", "heads": [HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim], "page_size": PAGE,
        "tolerance": {"max_abs_err": MAX_ABS, "rel_err": MAX_REL},
        "all_ok": all(r["ok"] for r in results),
        "cases": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("all_ok", report["all_ok"])


if __name__ == "__main__":
    main()
