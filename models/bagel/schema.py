"""BAGEL's knobs, typed (no torch: the gateway's OpenAPI document reads them): the placement's
``model_kwargs`` (``BagelSettings``) and a request's (``BagelRequest``). A request knob left out
takes its mode's default (text-to-image: cfg_text 4, cfg_img 1, interval [0.4, 1], renorm global;
editing: cfg_text 4, cfg_img 2, interval [0, 1], renorm text_channel), as the reference's demo."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.models.knobs import Knobs

MAX_STEPS = 100  # flow timesteps a request may ask for (Euler steps: one fewer)
MAX_NEW_TOKENS = 4096  # decode loop bound; a request's max_tokens is at most this and max_seq_len


class BagelSettings(Knobs):
    checkpoint: str = Field("ByteDance-Seed/BAGEL-7B-MoT", description="repo id or directory of the official layout")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="weights and activations; default bfloat16 on a GPU, float32 on a CPU")
    cfg_parallel: bool = Field(False, description="walk image_gen_cfg: the three CFG branches as nodes of their own")
    kv_cache_bytes: int | None = Field(None, ge=1 << 20, description="the LLM's KV cache; default 64 MiB on a CPU, "
                                                                     "gpu_memory_fraction of free memory on a GPU")
    gpu_memory_fraction: float = Field(0.5, gt=0, lt=1, description="of the GPU's free memory for the KV cache")
    prefill_attention: Literal["auto", "fa2", "fa3"] = Field(
        "auto", description="FlashInfer's kernels for image blocks and flow steps: auto is fa3 on Hopper (a JIT "
                            "compile of its own on a fresh host), fa2 elsewhere")
    max_images: int = Field(4, ge=1, le=16, description="a request's n at most")
    max_side: int = Field(1024, ge=16, le=1024, description="generated height / width at most (pixels)")
    vae_image: tuple[int, int] = Field((1024, 512), description="input images for the VAE: [longest side at most, "
                                                                "shortest side at least]")
    vit_image: tuple[int, int] = Field((980, 224), description="... and then for the ViT")


class BagelRequest(Knobs):
    mode: Literal["text_to_image", "edit", "understand"] | None = Field(
        None, description="default: understand with an input image, text_to_image without")
    think: bool = Field(False, description="decode a plan first (its text is an output), then answer / generate")
    height: int = Field(1024, ge=16, le=1024, multiple_of=16, description="text-to-image height (pixels)")
    width: int = Field(1024, ge=16, le=1024, multiple_of=16, description="text-to-image width (pixels)")
    steps: int = Field(50, ge=2, le=MAX_STEPS, description="flow timesteps (Euler steps: one fewer)")
    timestep_shift: float = Field(3.0, ge=0.1, le=100, description="t' = s t / (1 + (s - 1) t)")
    cfg_text: float | None = Field(None, ge=0, le=100, description="text guidance scale (1: none)")
    cfg_img: float | None = Field(None, ge=0, le=100, description="image guidance scale (1: none)")
    cfg_interval: tuple[float, float] | None = Field(None, description="guidance applies for t in (start, end]")
    cfg_renorm: Literal["global", "channel", "text_channel"] | None = Field(None, description="guided velocity renorm")
    cfg_renorm_min: float = Field(0.0, ge=0, le=1, description="lower clamp of the renorm scale")
    seed: int | None = Field(None, ge=0, lt=2 ** 63, description="noise seed (the reference's torch.manual_seed stream)")
    n: int = Field(1, ge=1, le=16, description="images from the same context")
    max_tokens: int = Field(512, ge=1, le=MAX_NEW_TOKENS, description="understanding: tokens decoded at most")
    think_max_tokens: int = Field(1024, ge=1, le=MAX_NEW_TOKENS, description="think mode: plan tokens at most")
    ignore_eos: bool = Field(False, description="decode max_tokens (think_max_tokens) tokens whatever is sampled, "
                                                "end-of-text included (benchmarks; the text still ends there)")

    RENAMED = {"num_timesteps": "M* calls it steps", "num_inference_steps": "M* calls it steps",
               "cfg_text_scale": "M* calls it cfg_text", "cfg_img_scale": "M* calls it cfg_img",
               "guidance_scale": "M* calls it cfg_text", "cfg_renorm_type": "M* calls it cfg_renorm",
               "max_think_token_n": "M* calls it think_max_tokens", "image_shapes": "M* calls them height and width",
               "max_new_tokens": "M* calls it max_tokens"}
