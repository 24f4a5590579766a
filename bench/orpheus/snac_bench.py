"""SNAC 24 kHz window decodes on the GPU: ms per batch of 4-frame windows (28 codes), by
dtype, eager vs CUDA graph; and the LLM-sized GEMM stream slowed by concurrent decodes.

    python bench/orpheus/snac_bench.py --root CKPT_ROOT --out $OUT/snac_bench.json
"""

import argparse
import json
import time
from pathlib import Path

import torch

from mstar.models.orpheus.snac import load_snac_decoder


def timed(fn, n=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    path = Path(args.root) / "hubertsiuzdak" / "snac_24khz"
    res = {"device": torch.cuda.get_device_name(), "decode_ms": {}}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dec = load_snac_decoder(path, device="cuda")
        dec = dec.to(dtype)
        for b in (1, 4, 9, 16, 32):
            codes = [torch.randint(0, 4096, (b, 4 * k), device="cuda") for k in (1, 2, 4)]

            def run(dec=dec, codes=codes):
                with torch.inference_mode():
                    return dec.decode(codes, checked=True)
            try:
                ms = timed(run)
            except Exception as e:  # noqa: BLE001
                ms = f"{type(e).__name__}: {e}"[:200]
            res["decode_ms"][f"{str(dtype)[6:]}_b{b}"] = ms
            print(dtype, b, ms, flush=True)
        if dtype is torch.float32:
            out = run()
            ref = out.float()
    # LLM-like weight streaming (a 3B model's GEMMs at batch 64) alone and with decodes alongside
    w = torch.randn(3072 * 8, 3072 * 3, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 3072 * 8, device="cuda", dtype=torch.bfloat16)
    gemm = timed(lambda: x @ w, 50)
    dec32 = load_snac_decoder(path, device="cuda")
    codes = [torch.randint(0, 4096, (9, 4 * k), device="cuda") for k in (1, 2, 4)]
    side = torch.cuda.Stream()

    def both():
        with torch.cuda.stream(side), torch.inference_mode():
            dec32.decode(codes, checked=True)
        for _ in range(20):
            x @ w
    both_ms = timed(both, 10)
    res["gemm_alone_ms"] = gemm
    res["gemm_x20_plus_snac_b9_ms"] = both_ms
    res["snac_alone_b9_ms"] = res["decode_ms"]["float32_b9"]
    print(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1))
    del ref


if __name__ == "__main__":
    main()
