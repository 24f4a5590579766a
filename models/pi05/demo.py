"""A tiny random π0.5 checkpoint directory in the real layout (``--random-weights``, tests): config.json,
model.safetensors with openpi names, a PaliGemma-style ``tokenizer.json`` (BPE over characters with
byte fallback, ``<bos>`` = 2) and lerobot normalisation statistics for an 8-dimensional robot."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import torch

from mstar.models.pi05.config import Pi05Config, tiny_config
from mstar.models.pi05.stats import write_lerobot_stats
from mstar.models.pi05.weights import write_checkpoint

DEMO_STATE_DIM = 8


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "S"), ("▁", "T"), ("▁", "A")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(specials)
    tok.save(str(directory / "tokenizer.json"))


def write_demo_checkpoint(directory: str | Path, cfg: Pi05Config | None = None, seed: int = 0,
                          stats: bool = True, dtype: torch.dtype = torch.float32) -> Path:
    """``dtype``: the tensors' (the full-size benchmark writes bfloat16)."""
    directory = write_checkpoint(directory, cfg or tiny_config(), seed=seed, dtype=dtype)
    write_tokenizer(directory)
    if stats:
        rng = np.random.default_rng(seed)
        lo = rng.uniform(-2, 0, DEMO_STATE_DIM)
        write_lerobot_stats(directory, {"q01": lo, "q99": lo + rng.uniform(0.5, 3, DEMO_STATE_DIM)},
                            {"q01": lo, "q99": lo + 2.0})
    return directory
