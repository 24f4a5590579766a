"""Produce bagel_reference.safetensors / bagel_reference.json with the public BAGEL implementation
(github.com/ByteDance-Seed/Bagel), run OUTSIDE this repository in its own venv (see README.md).

    python make_reference.py BAGEL_SRC CKPT_DIR OUT_DIR

BAGEL_SRC: the extracted reference tree with its bf16 casts removed (README.md says how).
CKPT_DIR: the tiny checkpoint ``mstar.models.bagel.demo.write_checkpoint(CKPT_DIR, seed=0)`` writes.
This script only imports the reference; what it adds are stand-ins for packages the CPU venv
lacks: flash_attn's varlen function on torch SDPA, and torchvision's resize / ToTensor / Normalize
(for PIL images torchvision resizes with PIL itself, as the stand-in does)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

FLASH_ATTN = '''
import torch
import torch.nn.functional as F

def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=False, **kw):
    out = []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qb, kb, vb = q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        lq, lk = qb.shape[0], kb.shape[0]
        rep = qb.shape[1] // kb.shape[1]
        kb, vb = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
        mask = None
        if causal:  # flash-attn aligns the causal mask to the bottom right
            mask = torch.arange(lk, device=q.device)[None, :] <= (lk - lq + torch.arange(lq, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qb.transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1), attn_mask=mask)
        out.append(o.transpose(0, 1))
    return torch.cat(out)
'''
TORCHVISION = {
    "__init__.py": "from . import transforms\n",
    "transforms/__init__.py": '''
import torch
import numpy as np
from . import functional
from .functional import InterpolationMode

class ToTensor:
    def __call__(self, img):
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous().to(torch.float32).div(255)

class Normalize:
    def __init__(self, mean, std, inplace=False):
        self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]
    def __call__(self, t):
        return t.sub_(self.mean).div_(self.std)

class Compose:
    def __init__(self, ts):
        self.ts = ts
    def __call__(self, x):
        for t in self.ts:
            x = t(x)
        return x
''',
    "transforms/functional.py": '''
import enum
from PIL import Image

class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"

_PIL = {InterpolationMode.NEAREST: Image.NEAREST, InterpolationMode.BILINEAR: Image.BILINEAR, InterpolationMode.BICUBIC: Image.BICUBIC}

def resize(img, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
    return img.resize((size[1], size[0]), _PIL[interpolation])
''',
    "transforms/InterpolationMode.py": "",
}


def install_stand_ins(only_missing: bool = False) -> None:
    """Stand-ins for flash_attn, cv2 and torchvision; with ``only_missing``, for those not installed."""
    import importlib.util

    def wanted(name: str) -> bool:
        return not only_missing or importlib.util.find_spec(name) is None

    root = Path(tempfile.mkdtemp(prefix="bagel-stand-ins-"))
    if wanted("flash_attn"):
        (root / "flash_attn").mkdir()
        (root / "flash_attn" / "__init__.py").write_text(textwrap.dedent(FLASH_ATTN))
    if wanted("cv2"):
        (root / "cv2").mkdir()
        (root / "cv2" / "__init__.py").write_text("")  # imported by data/transforms.py for augmentations only
    for name, text in TORCHVISION.items() if wanted("torchvision") else ():
        path = root / "torchvision" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    sys.path.insert(0, str(root))


def image(seed: int, w: int, h: int):
    """A smooth non-square RGB test image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    a = rng.uniform(0.02, 0.2, size=(3, 2))
    px = np.stack([127 + 120 * np.sin(a[c, 0] * xx + a[c, 1] * yy + c) for c in range(3)], -1)
    return Image.fromarray(px.clip(0, 255).astype(np.uint8))


SCENARIOS = {
    "understand": dict(prompt="what is in this picture?", image=(3, 100, 60), kw=dict(understanding_output=True,
                       max_think_token_n=12, do_sample=False)),
    "t2i": dict(prompt="a photo of a red cat", seed=7, kw=dict(cfg_text_scale=4.0, cfg_img_scale=1.0, cfg_interval=[0.4, 1.0],
                timestep_shift=3.0, num_timesteps=8, cfg_renorm_min=0.0, cfg_renorm_type="global", image_shapes=(48, 80))),
    "edit": dict(prompt="make the dog wear a green hat", image=(4, 100, 60), seed=11, kw=dict(cfg_text_scale=4.0,
                 cfg_img_scale=2.0, cfg_interval=[0.0, 1.0], timestep_shift=3.0, num_timesteps=6, cfg_renorm_min=0.0,
                 cfg_renorm_type="text_channel")),
    "think": dict(prompt="draw the sky at night", seed=5, kw=dict(think=True, max_think_token_n=10, do_sample=False,
                  cfg_text_scale=4.0, cfg_img_scale=1.0, cfg_interval=[0.4, 1.0], timestep_shift=3.0, num_timesteps=5,
                  cfg_renorm_min=0.0, cfg_renorm_type="channel", image_shapes=(64, 48))),
}
VAE_FIT, VIT_FIT = (96, 48, 16), (70, 42, 14)


def reference_model(ckpt, ch: int, ch_mult, num_res_blocks: int, device: str = "cpu", dtype=None):
    """The reference's Bagel, its VAE (these widths), tokenizer and special ids on ``ckpt``, built as
    its app.py builds them, in ``dtype`` (default: fp32) on ``device``. The reference tree must be on
    sys.path (and the stand-ins installed where its dependencies are missing)."""
    import torch
    from data.data_utils import add_special_tokens
    from modeling.autoencoder import AutoEncoder, AutoEncoderParams
    from modeling.bagel import (
        Bagel,
        BagelConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
        SiglipVisionConfig,
        SiglipVisionModel,
    )
    from modeling.qwen2 import Qwen2Tokenizer
    from safetensors.torch import load_file

    ckpt = str(ckpt)
    llm_config = Qwen2Config.from_json_file(os.path.join(ckpt, "llm_config.json"))
    llm_config.qk_norm, llm_config.tie_word_embeddings, llm_config.layer_module = True, False, "Qwen2MoTDecoderLayer"
    vit_config = SiglipVisionConfig.from_json_file(os.path.join(ckpt, "vit_config.json"))
    vit_config.rope = False
    vit_config.num_hidden_layers -= 1
    ae_params = AutoEncoderParams(resolution=256, in_channels=3, downsample=8, ch=ch, out_ch=3, ch_mult=list(ch_mult),
                                  num_res_blocks=num_res_blocks, z_channels=16, scale_factor=0.3611, shift_factor=0.1159)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        with torch.device(device):
            vae = AutoEncoder(ae_params)
            config = BagelConfig(visual_gen=True, visual_und=True, llm_config=llm_config, vit_config=vit_config,
                                 vae_config=ae_params, vit_max_num_patch_per_side=70, connector_act="gelu_pytorch_tanh",
                                 latent_patch_size=2, max_latent_size=64)
            model = Bagel(Qwen2ForCausalLM(llm_config), SiglipVisionModel(vit_config), config)
            model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    finally:
        torch.set_default_dtype(default)
    vae.load_state_dict(load_file(os.path.join(ckpt, "ae.safetensors"), device=device), strict=True)
    model.load_state_dict(load_file(os.path.join(ckpt, "ema.safetensors"), device=device), strict=True)
    tokenizer, new_token_ids, _ = add_special_tokens(Qwen2Tokenizer.from_pretrained(ckpt))
    return model.eval(), vae.eval(), tokenizer, new_token_ids


def main(src: str, ckpt: str, out_dir: str) -> None:
    install_stand_ins()
    sys.path.insert(0, src)
    import numpy as np
    import torch
    from data.data_utils import patchify
    from data.transforms import ImageTransform
    from inferencer import InterleaveInferencer
    from modeling.bagel.qwen2_navit import NaiveCache
    from safetensors.torch import save_file

    torch.set_grad_enabled(False)
    # the model as the reference's app.py builds it, with the tiny checkpoint's VAE widths
    model, vae, tokenizer, new_token_ids = reference_model(ckpt, ch=32, ch_mult=(1, 2, 2, 2), num_res_blocks=1)
    llm_config = model.language_model.config
    vae_t, vit_t = ImageTransform(*VAE_FIT), ImageTransform(*VIT_FIT)
    inferencer = InterleaveInferencer(model, vae, tokenizer, vae_t, vit_t, new_token_ids)

    tensors: dict[str, torch.Tensor] = {}
    meta: dict = {"vae_fit": VAE_FIT, "vit_fit": VIT_FIT, "scenarios": {}}
    record: dict = {}

    def wrap(obj, name, key):
        orig = getattr(obj, name)

        def wrapped(*a, **kw):
            out = orig(*a, **kw)
            record.setdefault(key, []).append((a, kw, out))
            return out
        setattr(obj, name, wrapped)

    wrap(model, "generate_text", "text")
    wrap(model, "generate_image", "image")
    wrap(model, "prepare_vae_latent", "noise")
    wrap(vae, "encode", "vae_encode")

    for name, s in SCENARIOS.items():
        record.clear()
        img = image(*s["image"]) if "image" in s else None
        torch.manual_seed(s.get("seed", 0))
        res = inferencer(image=img, text=s["prompt"], **s["kw"])
        m = {"prompt": s["prompt"], "kw": {k: list(v) if isinstance(v, tuple) else v for k, v in s["kw"].items()},
             "seed": s.get("seed", 0), "image": s.get("image"), "text": res["text"]}
        if "text" in record:
            m["token_ids"] = record["text"][0][2][:, 0].tolist()  # starts with <|im_start|>
        if "image" in record:
            tensors[f"{name}.latent"] = record["image"][0][2][0].contiguous()
            tensors[f"{name}.noise"] = record["noise"][0][2]["packed_init_noises"].contiguous()
            tensors[f"{name}.pixels"] = torch.from_numpy(np.asarray(res["image"]).copy())
        if "vae_encode" in record:
            tensors[f"{name}.vae_latent"] = record["vae_encode"][0][2][0].contiguous()
        meta["scenarios"][name] = m
        if name == "edit":  # the three contexts of the edit, for single flow steps below
            edit_ctx = record["image"][0][1]

    # one flow step of the edit's contexts at t inside the interval: the three velocities
    # (llm2vae's outputs, in the order _forward_flow computes them: conditional, text-, image-
    # unconditional) and the guided one under each renorm. A random tiny model's three velocities
    # are nearly equal, so no renorm would engage; for the combination the hook also returns
    # perturbed text- and image-unconditional velocities (recorded as flow.w_*), which it does.
    gen = torch.Generator().manual_seed(99)
    x_t = torch.randn(edit_ctx["packed_init_noises"].shape, generator=gen)
    t = torch.tensor([0.7] * x_t.shape[0])
    tensors["flow.x_t"] = x_t
    rows = x_t.shape[0] + 2
    push = [None, torch.randn(rows, x_t.shape[1], generator=gen) * torch.linspace(0.2, 3, rows)[:, None],
            -0.5 * torch.randn(rows, x_t.shape[1], generator=gen) * torch.linspace(3, 0.2, rows)[:, None]]
    parts: list = []
    perturb = [False]

    def hook(mod, inp, out):
        k = len(parts)
        out = out + push[k] if perturb[0] and push[k] is not None else out
        parts.append(out)
        return out
    handle = model.llm2vae.register_forward_hook(hook)
    keys = ("packed_vae_token_indexes", "packed_vae_position_ids", "packed_text_ids", "packed_text_indexes",
            "packed_position_ids", "packed_indexes", "packed_seqlens", "key_values_lens", "past_key_values",
            "packed_key_value_indexes")
    cfg = {k: v for k, v in edit_ctx.items() if k.startswith(("cfg_text_", "cfg_img_")) and k not in ("cfg_text_scale", "cfg_img_scale")}
    vae_rows = edit_ctx["packed_vae_token_indexes"]
    for perturbed, prefix in ((False, "v"), (True, "w")):
        perturb[0] = perturbed
        for renorm in ("global", "channel", "text_channel"):
            parts.clear()
            v = model._forward_flow(x_t=x_t, timestep=t, **{k: edit_ctx[k] for k in keys}, cfg_renorm_min=0.0,
                                    cfg_renorm_type=renorm, cfg_text_scale=4.0, cfg_img_scale=2.0, **cfg)
            tensors[f"flow.{prefix}.{renorm}"] = v.contiguous()
            for part, out in zip(("cond", "text", "img"), parts, strict=True):
                tensors[f"flow.{prefix}_{part}"] = out[vae_rows].contiguous()
    handle.remove()

    # the ViT over two packed non-square images (pre-connector), and with connector + position table
    ims = [vit_t(vit_t.resize_transform(image(3, 100, 60))), vit_t(image(8, 42, 70))]
    ids = [model.get_flattened_position_ids(im.shape[1], im.shape[2], 14, max_num_patches_per_side=70) for im in ims]
    pix = torch.cat([patchify(im, 14) for im in ims])
    lens = torch.tensor([len(i) for i in ids], dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
    vit_out = model.vit_model(packed_pixel_values=pix, packed_flattened_position_ids=torch.cat(ids), cu_seqlens=cu,
                              max_seqlen=int(lens.max()))
    tensors["vit.pixels0"], tensors["vit.pixels1"] = ims[0].contiguous(), ims[1].contiguous()
    tensors["vit.hidden"] = vit_out.contiguous()
    tensors["vit.embeds"] = (model.connector(vit_out) + model.vit_pos_embed(torch.cat(ids))).contiguous()

    # the MoT layer stack: a causal text block (understanding expert), then a non-causal mixed block
    # [soi, 6 latent rows, eoi] (markers: understanding, latents: generation) over it
    cache = NaiveCache(llm_config.num_hidden_layers)
    gi, lens_, rope = model.prepare_prompts(curr_kvlens=[0], curr_rope=[0], prompts=["a red cat"], tokenizer=tokenizer,
                                            new_token_ids=new_token_ids)
    cache = model.forward_cache_update_text(cache, **gi)
    n = 8
    seq = torch.randn(n, llm_config.hidden_size, generator=gen)
    kv = lens_[0]
    mixed = model.language_model.forward_inference(
        packed_query_sequence=seq, query_lens=torch.tensor([n]), packed_query_position_ids=torch.full((n,), rope[0]),
        packed_query_indexes=torch.arange(kv, kv + n), past_key_values=cache, key_values_lens=torch.tensor([kv]),
        packed_key_value_indexes=torch.arange(kv), update_past_key_values=True, is_causal=False, mode="gen",
        packed_vae_token_indexes=torch.arange(1, n - 1), packed_text_indexes=torch.tensor([0, n - 1]))
    tensors["mot.text_ids"] = gi["packed_text_ids"]
    tensors["mot.input"] = seq
    tensors["mot.hidden"] = mixed.packed_query_sequence.contiguous()
    for layer in (0, llm_config.num_hidden_layers - 1):
        tensors[f"mot.k{layer}"] = cache.key_cache[layer].contiguous()
        tensors[f"mot.v{layer}"] = cache.value_cache[layer].contiguous()

    out = Path(out_dir)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "bagel_reference.safetensors"))
    (out / "bagel_reference.json").write_text(json.dumps(meta, indent=1))
    print({k: tuple(v.shape) for k, v in tensors.items()})
    print(json.dumps(meta["scenarios"], indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
