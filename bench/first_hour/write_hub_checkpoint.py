"""Write a random Orpheus checkpoint (full size by default: Llama-3.2-3B shape, bf16; SNAC 24 kHz)
in the Hugging Face hub cache layout, as `hf download` leaves it:

    DIR/models--canopylabs--orpheus-3b-0.1-ft/{refs/main, snapshots/<commit>/...}
    DIR/models--hubertsiuzdak--snac_24khz/{refs/main, snapshots/<commit>/...}

so that `mstar serve orpheus --cache-dir DIR` finds it as it would the real one. Random weights
are valid for speed (the compute is the same); the audio is noise.

    python bench/first_hour/write_hub_checkpoint.py DIR [--tiny]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mstar.models.orpheus.demo_checkpoint import write_random_snac
from mstar.models.orpheus.demo_tokenizer import build_demo_tokenizer
from mstar.models.orpheus.snac_config import SnacConfig
from mstar.models.orpheus.tokens import ORPHEUS_VOCAB_SIZE

LLM, SNAC = "canopylabs/orpheus-3b-0.1-ft", "hubertsiuzdak/snac_24khz"
COMMIT = "0000000000000000000000000000000000random"  # a fake commit: refs/main points at it
FULL = {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
        "num_key_value_heads": 8, "head_dim": 128}  # Llama-3.2-3B
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
SNAC_24K = SnacConfig(sampling_rate=24000, encoder_dim=48, encoder_rates=(2, 4, 8, 8), decoder_dim=1024,
                      decoder_rates=(8, 8, 4, 2), attn_window_size=None, codebook_size=4096, codebook_dim=8,
                      vq_strides=(4, 2, 1), noise=True, depthwise=True)


def snapshot_dir(root: Path, repo: str) -> Path:
    org, name = repo.split("/")
    base = root / f"models--{org}--{name}"
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(COMMIT)
    return base / "snapshots" / COMMIT


def write(root: Path, tiny: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    cfg = LlamaConfig(vocab_size=ORPHEUS_VOCAB_SIZE, **(TINY if tiny else FULL), rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      bos_token_id=128000, eos_token_id=128258)
    llm = snapshot_dir(root, LLM)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(llm, safe_serialization=True)
    del model
    build_demo_tokenizer().save(str(llm / "tokenizer.json"))
    snac = SNAC_24K if not tiny else SnacConfig(**{**SNAC_24K.to_dict(), "decoder_dim": 64, "encoder_dim": 4})
    write_random_snac(snapshot_dir(root, SNAC), snac)
    return {"llm_params": params, "tiny": tiny, "write_s": round(time.perf_counter() - t0, 1), "root": str(root)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", type=Path)
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same layout (a CPU smoke run)")
    print(json.dumps(write(p.parse_args().root, p.parse_args().tiny)))


if __name__ == "__main__":
    main()
