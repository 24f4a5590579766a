"""SNAC 24 kHz decoded in bfloat16 / float16 against the float32 reference: the SNR of the audio,
on random and structured codes, for the module decoder and the fused Triton decode; and, as the
fidelity bar, how much the reference itself varies from one decode to the next (its decoder adds
fresh Gaussian noise on every decode, `snac_noise`, as the official one does).

    python bench/orpheus/snac_fidelity.py --out $OUT/snac_fidelity.json [--snac DIR] [--bar-db DB]

SNR = 10 log10(sum ref^2 / sum (ref - x)^2) per decoded window (4 frames, 28 codes, as the SNAC node
decodes them) and per 64-frame sequence; the candidates decode without noise against the float32
reference without noise (same codes: only the arithmetic differs). The bar (`--bar-db`, default 30:
the error at most 0.1% of the signal's energy), raised to the reference's own variation where that
is higher: the SNR between two float32 decodes of the same codes with noise on. A dtype meets it
when its worst input's median window SNR is at or above the bar; the record says which default that
implies for `snac_dtype` on CUDA (`auto` resolves to bfloat16 there since it met the bar).

Inputs:
- `random`: uniform codes in [0, 4096) at every level;
- `steady`: one random frame's codes repeated (a held sound);
- `sparse`: codes drawn from 64 values per level (a narrow part of each codebook, as real speech
  uses a skewed subset);
- `encoded`: the codes SNAC's own encoder gives for a 24 kHz signal of chirps and harmonics (needs
  the `snac` package; skipped without it).

--snac: a SNAC checkpoint folder (config.json + pytorch_model.bin: the real hubertsiuzdak/snac_24khz
where the host has it). Without it a random checkpoint of the real 24 kHz shape is written: valid
for the arithmetic, not for the real weights' ranges; the record says which (`weights`).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from mstar.models.orpheus.demo_checkpoint import write_random_snac
from mstar.models.orpheus.snac import load_snac_decoder
from mstar.models.orpheus.snac_config import SnacConfig

SNAC_24K = SnacConfig(sampling_rate=24000, encoder_dim=48, encoder_rates=(2, 4, 8, 8), decoder_dim=1024,
                      decoder_rates=(8, 8, 4, 2), attn_window_size=None, codebook_size=4096, codebook_dim=8,
                      vq_strides=(4, 2, 1), noise=True, depthwise=True)
#: the stated fidelity bar (docs/models/orpheus.md): a candidate's audio within 30 dB SNR of the float32 reference's,
#: i.e. its error carries at most 0.1% of the signal's energy
BAR_DB = 30.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per row of [B, ...]: 10 log10(signal / error) in dB (inf where equal)."""
    ref, x = ref.flatten(1).double(), x.flatten(1).double()
    err = (ref - x).pow(2).sum(1)
    return 10 * torch.log10(ref.pow(2).sum(1) / err.clamp_min(1e-30))


def codes_for(kind: str, frames: int, batch: int, gen: torch.Generator, encoder=None) -> list[torch.Tensor] | None:
    """SNAC code levels [B, frames * (1, 2, 4)] of one input kind."""
    shapes = (frames, 2 * frames, 4 * frames)
    if kind == "random":
        return [torch.randint(0, 4096, (batch, n), generator=gen) for n in shapes]
    if kind == "steady":
        one = [torch.randint(0, 4096, (batch, k), generator=gen) for k in (1, 2, 4)]
        return [c.repeat(1, frames) for c in one]
    if kind == "sparse":
        return [torch.randint(0, 64, (batch, n), generator=gen) * 61 for n in shapes]
    if kind == "encoded":
        if encoder is None:
            return None
        t = torch.arange(frames * 2048, dtype=torch.float64) / 24000
        rows = []
        for b in range(batch):
            f0 = 110 * 2 ** (b / max(batch, 1))  # each row its own pitch
            sweep = torch.sin(2 * math.pi * (f0 * t + 200 * t**2))  # a chirp
            tones = sum(torch.sin(2 * math.pi * f0 * h * t) / h for h in range(1, 6))  # harmonics
            rows.append(0.3 * (sweep + 0.5 * tones) * (0.6 + 0.4 * torch.sin(2 * math.pi * 3 * t)))
        audio = torch.stack(rows).float().unsqueeze(1)
        with torch.inference_mode():
            codes = encoder.encode(audio)
        return [c[:, :n].cpu() for c, n in zip(codes, shapes, strict=True)]
    raise ValueError(kind)


def load_encoder(directory: Path):
    """snac's own model (with its encoder) from the checkpoint, or None without the package."""
    try:
        import snac
    except ImportError:
        return None
    cfg = json.loads((directory / "config.json").read_text())
    model = snac.SNAC(**cfg).eval()
    model.load_state_dict(torch.load(directory / "pytorch_model.bin", map_location="cpu"))
    return model


def decoders(directory: Path, device: str, kernels: list[str]) -> dict[str, object]:
    """name -> a callable (levels, noise, generator) -> audio [B, 1, T] float32 on the host."""
    out = {}
    for dname, dtype in DTYPES.items():
        module = load_snac_decoder(directory, device=device, dtype=dtype)
        if "torch" in kernels:
            out[f"torch/{dname}"] = (lambda m: lambda lv, noise, g: m.decode(lv, noise=noise, generator=g))(module)
        if "triton" in kernels:
            from mstar.models.orpheus.snac_triton import SnacTritonDecoder

            try:
                fused = SnacTritonDecoder(module)
            except Exception as e:  # a dtype the fused kernels do not take: recorded, not fatal
                print(f"triton/{dname}: unavailable: {e}", flush=True)
                continue
            out[f"triton/{dname}"] = (lambda f: lambda lv, noise, g: f.decode(lv, noise=noise, generator=g))(fused)
    return out


@torch.inference_mode()
def measure(directory: Path, device: str, kernels: list[str], batch: int, seq_frames: int, seed: int) -> dict:
    decs = decoders(directory, device, kernels)
    encoder = load_encoder(directory)
    ref_name = f"{kernels[0]}/float32"
    results: dict = {}
    for kind in ("random", "steady", "sparse", "encoded"):
        for shape, frames, rows in (("window", 4, batch), ("sequence", seq_frames, 4)):
            gen = torch.Generator().manual_seed(seed)
            codes = codes_for(kind, frames, rows, gen, encoder)
            if codes is None:
                continue
            lv = [c.to(device) for c in codes]

            def run(name, noise, noise_seed=0, lv=lv):
                g = torch.Generator(device=device).manual_seed(noise_seed) if noise else None
                return decs[name](lv, noise, g).float().cpu()

            ref = run(ref_name, False)
            entry = {"reference": ref_name, "rms": float(ref.pow(2).mean().sqrt())}
            # the bar: the reference against itself, fresh noise each decode
            self_snr = snr_db(run(ref_name, True, 1), run(ref_name, True, 2))
            entry["reference_noise_vs_noise_db"] = _stats(self_snr)
            for name in decs:
                if name != ref_name:
                    try:
                        entry[name] = _stats(snr_db(ref, run(name, False)))
                    except Exception as e:  # recorded, not fatal: the other candidates still count
                        entry[name + " error"] = f"{type(e).__name__}: {e}"[:300]
            results[f"{kind}/{shape}"] = entry
            print(kind, shape, json.dumps({k: v["median"] if isinstance(v, dict) else v for k, v in entry.items()}),
                  flush=True)
    return results


def _stats(x: torch.Tensor) -> dict:
    x = x[torch.isfinite(x)] if torch.isfinite(x).any() else x
    return {"median": round(float(x.median()), 2), "min": round(float(x.min()), 2), "n": int(x.numel())}


def verdict(results: dict, bar_db: float) -> dict:
    """Per candidate: its worst median window SNR over the inputs, the bar, and whether it meets it.
    The bar: ``bar_db``, or the reference's own noise-to-noise SNR where that is higher."""
    noise = min(e["reference_noise_vs_noise_db"]["median"] for k, e in results.items() if k.endswith("/window"))
    bar = max(bar_db, noise)
    out = {"bar_db": bar, "bar": f"max({bar_db} dB, the float32 reference's own noise-to-noise SNR "
                                 f"(lowest input's median): {noise} dB)"}
    names = {n for e in results.values() for n in e if "/" in n and not n.endswith(" error")}
    for name in sorted(names):
        worst = min(e[name]["median"] for k, e in results.items() if k.endswith("/window") and name in e)
        out[name] = {"worst_median_window_snr_db": worst, "meets_bar": worst >= bar}
    fast = [n for n in ("triton/bfloat16", "torch/bfloat16") if out.get(n, {}).get("meets_bar")]
    out["implied_snac_dtype_default"] = "bfloat16" if fast else "float32"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--snac", type=Path, help="SNAC checkpoint folder (default: a random one of the real shape)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", default=None, help="torch,triton (default: both on CUDA, torch on a CPU)")
    p.add_argument("--batch", type=int, default=64, help="windows per input kind")
    p.add_argument("--seq-frames", type=int, default=64)
    p.add_argument("--bar-db", type=float, default=BAR_DB,
                   help="the SNR a candidate must reach (the reference's own noise-to-noise SNR where higher)")
    p.add_argument("--tiny", action="store_true", help="a tiny random SNAC (CPU smoke run: checks the script)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    kernels = (args.kernels or ("torch,triton" if args.device.startswith("cuda") else "torch")).split(",")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.snac
        if directory is None:
            directory = Path(tmp) / "snac"
            cfg = SNAC_24K if not args.tiny else SnacConfig(**{**SNAC_24K.to_dict(), "decoder_dim": 64,
                                                               "encoder_dim": 4})
            write_random_snac(directory, cfg, seed=args.seed)
        results = measure(directory, args.device, kernels, args.batch, args.seq_frames, args.seed)
    record = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__, "weights": str(args.snac) if args.snac else
        ("random, tiny" if args.tiny else "random, real 24 kHz shape"),
        "results": results, "verdict": verdict(results, args.bar_db), "seconds": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["verdict"], indent=2))


if __name__ == "__main__":
    main()
