"""A tiny random BAGEL checkpoint in the official layout (``--random-weights``, tests): the same
files and tensor names as ByteDance-Seed/BAGEL-7B-MoT, with a 2-layer LLM whose understanding and
generation experts are drawn independently, a 2-layer ViT (its config lists 3: one fewer runs), a
narrow FLUX VAE, and a small byte-level BPE tokenizer with Qwen2.5's pre-tokenizer and special
tokens (tokenizer.json, and vocab.json / merges.txt / tokenizer_config.json for Qwen2Tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from mstar.models.bagel.config import (
    AE,
    BOS,
    EMA,
    EOI,
    EOS,
    LLM_CONFIG,
    SOI,
    VIT_CONFIG,
    BagelConfig,
    VAEConfig,
)

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
ENDOFTEXT = "<|endoftext|>"
SPECIALS = (ENDOFTEXT, BOS, EOS, SOI, EOI)
CORPUS = ("a photo of a red cat sitting on a blue chair", "draw the sky at night with stars over the sea",
          "what is in this picture? describe the image in detail.", "make the dog wear a green hat",
          "The planning process is enclosed within <think> tags, then the image.", "0123456789 ,.;:!?'\"()[]{}-_/\\",
          "You should first think about the reasoning process in the mind and then provide the user with the answer.")
TINY_LLM = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "max_window_layers": 2,
            "tie_word_embeddings": False, "use_sliding_window": False, "torch_dtype": "bfloat16"}
TINY_VIT = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 2, "num_channels": 3, "image_size": 980, "patch_size": 14,
            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "attention_dropout": 0.0}
TINY_VAE = VAEConfig(ch=32, ch_mult=(1, 2, 2, 2), num_res_blocks=1)


def write_tokenizer(directory: Path, vocab_size: int = 384) -> int:
    """Train a byte-level BPE on a few sentences; returns the number of ids (specials included)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(directory / "tokenizer.json"))
    tok.model.save(str(directory))  # vocab.json, merges.txt: what Qwen2Tokenizer reads
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                                       "single_word": False, "special": True} for t in SPECIALS}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added, "additional_special_tokens": list(SPECIALS[1:]),
        "bos_token": None, "eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT, "unk_token": None, "errors": "replace",
        "clean_up_tokenization_spaces": False, "model_max_length": 32768, "split_special_tokens": False}, indent=1))
    return tok.get_vocab_size()


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    """Default inits are fine for linears; norms get weights near 1 and small biases so that a
    swapped norm or expert shows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.split(".")[-1]
            if p.dim() == 1 and leaf == "weight":
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1 and leaf == "bias":
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                bound = p.shape[-1] ** -0.5 if p.dim() == 2 else (p[0].numel()) ** -0.5
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)


def write_checkpoint(directory: str | Path, seed: int = 0) -> list[str]:
    from safetensors.torch import save_file

    from mstar.models.bagel.config import config_from_dir, llm_config, vit_config
    from mstar.models.bagel.flow import LatentAdapter
    from mstar.models.bagel.llm import BagelLLM
    from mstar.models.bagel.vae import AutoEncoder
    from mstar.models.bagel.vit import VisionEncoder
    from mstar.models.bagel.weights import latent_name, llm_name, vit_name

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    n_ids = write_tokenizer(d)
    llm_json = {**TINY_LLM, "vocab_size": n_ids}  # a random model may emit any id: each must decode
    (d / LLM_CONFIG).write_text(json.dumps(llm_json, indent=1))
    (d / VIT_CONFIG).write_text(json.dumps(TINY_VIT, indent=1))
    from mstar.models.bagel.config import SpecialTokens

    cfg = BagelConfig(llm_config(llm_json), vit_config(TINY_VIT), TINY_VAE, SpecialTokens(0, 0, 0, 0))
    gen = torch.Generator().manual_seed(seed)
    ema: dict[str, torch.Tensor] = {}
    for module, name in ((BagelLLM(cfg.llm), llm_name), (VisionEncoder(cfg), vit_name), (LatentAdapter(cfg), latent_name)):
        _randomize(module, gen)
        ema.update({name(n): p.detach().clone().contiguous() for n, p in module.named_parameters()})
        if hasattr(module, "pos_table"):  # the reference keeps its sin-cos tables as parameters
            ema[name("pos_table")] = module.pos_table.clone()
    vae = AutoEncoder(cfg.vae)
    _randomize(vae, gen)
    save_file(ema, str(d / EMA))
    save_file({n: p.detach().clone().contiguous() for n, p in vae.named_parameters()}, str(d / AE))
    config_from_dir(d)  # what was written loads
    return sorted(p.name for p in d.iterdir())


FULL_LLM = {**TINY_LLM, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "max_window_layers": 28, "vocab_size": 152064}
FULL_VIT = {**TINY_VIT, "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16}


def write_full_checkpoint(directory: str | Path, device: str = "cuda", seed: int = 0) -> list[str]:
    """BAGEL-7B-MoT's shapes with random bf16 weights (N(0, 0.02); norms 1, biases 0) and the small
    tokenizer (benchmarks: the ids it makes are valid, the text is not). ~29 GB; drawn on ``device``."""
    from safetensors.torch import save_file

    from mstar.models.bagel.config import SpecialTokens, llm_config, vit_config
    from mstar.models.bagel.flow import LatentAdapter
    from mstar.models.bagel.llm import BagelLLM
    from mstar.models.bagel.vae import AutoEncoder
    from mstar.models.bagel.vit import VisionEncoder, sincos_2d
    from mstar.models.bagel.weights import latent_name, llm_name, vit_name

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_tokenizer(d)
    (d / LLM_CONFIG).write_text(json.dumps(FULL_LLM, indent=1))
    (d / VIT_CONFIG).write_text(json.dumps(FULL_VIT, indent=1))
    cfg = BagelConfig(llm_config(FULL_LLM), vit_config(FULL_VIT), VAEConfig(), SpecialTokens(0, 0, 0, 0))
    gen = torch.Generator(device).manual_seed(seed)

    def draw(name: str, shape) -> torch.Tensor:
        leaf = name.split(".")[-1]
        if len(shape) == 1:
            t = torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
            return t.to(torch.bfloat16)
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02).cpu()

    with torch.device("meta"):
        parts = ((BagelLLM(cfg.llm), llm_name), (VisionEncoder(cfg), vit_name), (LatentAdapter(cfg), latent_name))
        vae = AutoEncoder(cfg.vae)
    ema = {name(n): draw(n, p.shape) for m, name in parts for n, p in m.named_parameters()}
    ema["vit_pos_embed.pos_embed"] = sincos_2d(cfg.llm.hidden_size, cfg.vit_max_patches_per_side)
    ema["latent_pos_embed.pos_embed"] = sincos_2d(cfg.llm.hidden_size, cfg.max_latent_size)
    save_file(ema, str(d / EMA))
    del ema
    save_file({n: draw(n, p.shape).float() for n, p in vae.named_parameters()}, str(d / AE))
    return sorted(p.name for p in d.iterdir())
