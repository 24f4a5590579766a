"""Write a tiny random Orpheus checkpoint for demo mode and tests.

Layout under `out_dir` (the same file layout as the real checkpoints, so the real loaders apply):
  orpheus/  config.json, generation_config.json, model.safetensors  (LlamaForCausalLM.save_pretrained)
            tokenizer.json, tokenizer_config.json                    (demo_tokenizer: official ids)
  snac/     config.json, pytorch_model.bin                           (snac's layout, weight norm unfolded)
The LLM keeps the full Orpheus vocab (156940 rows) with a tiny hidden size, so every special and
audio token id is valid; its output is random tokens, not speech. The SNAC model keeps the 24 kHz
rates (512 samples per latent step, 2048 per frame) with tiny channel counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .snac import SnacDecoder
from .snac_config import SnacConfig
from .snac_weights import WEIGHT_FILE, encoder_shapes, unfold_weight_norm
from .tokens import BEGIN_OF_TEXT, END_OF_SPEECH, ORPHEUS_VOCAB_SIZE, PAD

DEMO_SNAC = SnacConfig(
    sampling_rate=24000, encoder_dim=4, encoder_rates=(2, 4, 8, 8), decoder_dim=64,
    decoder_rates=(8, 8, 4, 2), attn_window_size=None, codebook_size=4096, codebook_dim=8,
    vq_strides=(4, 2, 1), noise=True, depthwise=True,
)


@dataclass(frozen=True)
class DemoSpec:
    seed: int = 0
    hidden_size: int = 16
    intermediate_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query like Llama-3.2-3B, and splits over tp_size 2
    max_position_embeddings: int = 4096
    snac: SnacConfig = DEMO_SNAC


@dataclass(frozen=True)
class DemoCheckpoint:
    llm_dir: Path
    snac_dir: Path


def write_demo_checkpoint(out_dir: str | Path, spec: DemoSpec = DemoSpec()) -> DemoCheckpoint:
    out = Path(out_dir)
    ckpt = DemoCheckpoint(out / "orpheus", out / "snac")
    write_random_llm(ckpt.llm_dir, spec)
    write_random_snac(ckpt.snac_dir, spec.snac, seed=spec.seed)
    return ckpt


def write_random_llm(directory: Path, spec: DemoSpec) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from .demo_tokenizer import BOS, EOT, build_demo_tokenizer

    config = LlamaConfig(
        vocab_size=ORPHEUS_VOCAB_SIZE, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads, max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=BEGIN_OF_TEXT, eos_token_id=END_OF_SPEECH, pad_token_id=PAD,
        tie_word_embeddings=True,  # as Llama-3.2-3B; halves the file
    )
    torch.manual_seed(spec.seed)
    LlamaForCausalLM(config).save_pretrained(directory)  # safetensors by default
    build_demo_tokenizer().save(str(directory / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def write_random_snac(directory: Path, cfg: SnacConfig, *, seed: int = 0) -> None:
    """A complete snac state dict (encoder included: `SNAC.load_state_dict` is strict) with
    non-trivial weight-norm gains and Snake alphas, so a loader that ignored them would be caught."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # module init of the decode path
    state = dict(SnacDecoder(cfg).state_dict())
    for name, shape in encoder_shapes(cfg).items():
        state[name] = 0.1 * torch.randn(shape, generator=gen) if name.endswith("weight") else torch.zeros(shape)
    for name, tensor in state.items():
        if name.endswith(".alpha"):
            state[name] = 0.5 + torch.rand(tensor.shape, generator=gen)
    conv_weights = [n for n, t in state.items() if n.endswith(".weight") and t.dim() == 3]
    gains = {}
    for name in conv_weights:
        w = state[name]
        norm = w.flatten(1).norm(dim=1)
        gains[name] = norm * (0.5 + torch.rand(norm.shape, generator=gen))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    torch.save(unfold_weight_norm(state, gains), directory / WEIGHT_FILE)
