"""A whole BAGEL request in one process, without the serving runtime: the same modules, engine
passes and request plan the served graph runs, called in order. Tests compare it with the
reference and with the mesh; the benchmark uses it as our single-process figure."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mstar.models.bagel.config import BagelConfig, config_from_dir
from mstar.models.bagel.engine import BagelLM
from mstar.models.bagel.flow import (
    FlowParams,
    LatentAdapter,
    cfg_combine,
    decode_pixels,
    draw_noise,
    patchify_latent,
    schedule,
    unpatchify_latent,
)
from mstar.models.bagel.llm import BagelLLM
from mstar.models.bagel.media import VAE_FIT, VIT_FIT, Fit, normalize, to_uint8
from mstar.models.bagel.requests import MAIN, plan, think_text
from mstar.models.bagel.vae import AutoEncoder
from mstar.models.bagel.vit import VisionEncoder
from mstar.models.bagel.weights import build
from mstar.services.engines.kv_engine import EngineConfig
from mstar.services.engines.layers import fuse_projections


def engine_config(device: str, max_seq_len: int, kv_cache_bytes: int | None = None, memory_fraction: float = 0.5,
                  prefill_attention: str = "auto") -> EngineConfig:
    """Direct passes only: no decode graphs, no pipelined steps."""
    if kv_cache_bytes is None and not device.startswith("cuda"):
        kv_cache_bytes = 64 << 20
    return EngineConfig(kv_cache_bytes=kv_cache_bytes, gpu_memory_fraction=memory_fraction, max_seq_len=max_seq_len,
                        prefill_attention=prefill_attention,
                        cuda_graphs=False, overlap=False)


def load_lm(directory: Path, cfg: BagelConfig, device: str, dtype: torch.dtype, config: EngineConfig,
            sequence_parallel=None) -> BagelLM:
    return BagelLM(cfg, fuse_projections(build(BagelLLM, cfg.llm, directory, "llm", device, dtype)),
                   build(LatentAdapter, cfg, directory, "latent", device, dtype), config, sequence_parallel)


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    think: str = ""
    latent: torch.Tensor | None = None  # [h·w, 64] after the last Euler step
    pixels: torch.Tensor | None = None  # uint8 [H, W, 3]


class BagelPipeline:
    def __init__(self, directory: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 vae_fit: Fit = VAE_FIT, vit_fit: Fit = VIT_FIT, max_seq_len: int = 16384, sequence_parallel=None):
        """``sequence_parallel``: this process's rank of a group that splits the LLM's passes
        (``BagelLM``); ranks past 0 then call ``self.lm.follow()``."""
        from tokenizers import Tokenizer

        d = Path(directory)
        self.cfg = cfg = config_from_dir(d)
        self.device, self.dtype, self.vae_fit, self.vit_fit = device, dtype, vae_fit, vit_fit
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.vit = build(VisionEncoder, cfg, d, "vit", device, dtype)
        self.vae = build(AutoEncoder, cfg.vae, d, "vae", device, dtype)
        self.lm = load_lm(d, cfg, device, dtype, engine_config(device, max_seq_len), sequence_parallel)
        self._n = 0

    def text_ids(self, text: str) -> torch.Tensor:
        t = self.cfg.tokens
        return torch.tensor([t.bos, *self.tokenizer.encode(text, add_special_tokens=False).ids, t.eos])

    @torch.inference_mode()
    def run(self, mode: str, prompt: str, image=None, think: bool = False, params: FlowParams | None = None,
            seed: int = 0, max_tokens: int = 64) -> Result:
        """``image``: an RGB PIL image (editing, understanding); ``params``: size and flow knobs."""
        self._n += 1
        rid, out, lm = f"pipeline-{self._n}", Result(), self.lm
        params = params or FlowParams(1024, 1024)
        if image is not None:
            image = self.vae_fit(image)
            if mode == "edit":
                params = dataclasses.replace(params, height=image.size[1], width=image.size[0])
        eps = None
        try:
            h, w = params.latent_hw(self.cfg.latent_downsample)
            if mode != "understand":
                shape = (1, self.cfg.vae.z_channels, image.size[1] // self.cfg.vae.downsample,
                         image.size[0] // self.cfg.vae.downsample) if mode == "edit" else None
                eps, noise = draw_noise(seed, h * w, self.cfg.patch_latent_dim, shape)
            for block in plan(mode, think, params.cfg_text, params.cfg_img, prompt):
                if block.kind == "text":
                    lm.prefill_text([(rid, block.labels, self.text_ids(block.text))])
                elif block.kind == "vit":
                    pixels = normalize(to_uint8(self.vit_fit(image))).to(self.device)
                    lm.prefill_image([(rid, block.labels, self.vit([pixels])[0])], generation=False)
                elif block.kind == "vae":
                    pixels = normalize(to_uint8(image))[None].to(self.device, self.dtype)
                    latent = self.vae.encode(pixels, eps.to(self.device))[0]
                    hh, ww = latent.shape[1] // 2, latent.shape[2] // 2
                    lm.prefill_image([(rid, block.labels, lm.vae_tokens(patchify_latent(latent), hh, ww))], generation=True)
                elif block.kind in ("decode", "think"):
                    ids = self.greedy(rid, max_tokens)
                    decoded = think_text(self.tokenizer.decode(ids, skip_special_tokens=False))
                    out.token_ids, out.text = ids, decoded
                    if block.kind == "think":
                        out.think = decoded
                        lm.rewind(rid)
                        lm.prefill_text([(rid, (MAIN,), self.text_ids(decoded))])
                elif block.kind == "generate":  # ("export" moves contexts between groups: nothing here)
                    out.latent = self.flow(rid, noise, params, block.labels)
                    z = unpatchify_latent(out.latent.to(self.dtype), h, w)[None]
                    out.pixels = decode_pixels(self.vae.decode(z.to(self.device))[0]).cpu()
        finally:
            lm.release(rid)
        return out

    def greedy(self, rid: str, max_tokens: int) -> list[int]:
        token, ids = self.cfg.tokens.bos, []
        for i in range(max_tokens):
            (token,) = self.lm.decode([(rid, token, i == 0)])
            ids.append(token)
            if token == self.cfg.tokens.eos:
                break
        return ids

    def flow(self, rid: str, x: torch.Tensor, p: FlowParams, labels: tuple[str, ...]) -> torch.Tensor:
        ts, dts = schedule(p.num_timesteps, p.shift)
        x = x.float()
        for t, dt in zip(ts.tolist(), dts.tolist(), strict=True):
            x = flow_step(self.lm, [(rid, x, t, dt, p, labels)])[0]
        return x


def flow_step(lm: BagelLM, steps: list[tuple[str, torch.Tensor, float, float, FlowParams, tuple[str, ...]]]) -> list[torch.Tensor]:
    """One Euler step of several requests: x - v·dt with v guided where its scales ask."""
    asks = []
    for rid, x, t, _, p, labels in steps:
        s_text, s_img = p.scales(t)  # the image CFG only applies on top of the text CFG
        need = [MAIN] + ([label for label, s in (("cfg_text", s_text), ("cfg_img", s_img)) if s > 1.0 and label in labels]
                         if s_text > 1.0 else [])
        asks.append((rid, x, t, p, tuple(need)))
    out = []
    for (_, x, t, dt, p, _), v in zip(steps, lm.velocities(asks), strict=True):
        s_text, s_img = p.scales(t)
        guided = cfg_combine(v[MAIN], v.get("cfg_text"), v.get("cfg_img"), s_text, s_img, p.renorm, p.renorm_min)
        out.append(x.float() - guided.to(x.device) * dt)
    return out
