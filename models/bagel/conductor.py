"""BAGEL's conductor side beyond the state machine: a request's images and noise, and its outputs
(text deltas from decoded token ids; PNG images)."""

from __future__ import annotations

import random
from typing import Any

import torch

from mstar.models.bagel.flow import draw_noise
from mstar.models.bagel.media import decode_rgb, to_uint8
from mstar.models.bagel.requests import plan
from mstar.models.base import Emit, InvalidArgument, Output, Prompt, RequestState
from mstar.models.graph import Modality
from mstar.models.tokens import encode_ids


def prepare(model, prompt: Prompt, kw: dict[str, Any]) -> RequestState:
    """The request's blocks, its input image at the VAE's and the ViT's sizes, its output size."""
    mode, cfg = kw["mode"], model.config()
    if mode == "text_to_image" and prompt.files:
        raise InvalidArgument("files", "text_to_image takes no image; send mode 'edit' or 'understand' with one")
    if mode == "edit" and len(prompt.files) != 1:
        raise InvalidArgument("files", f"mode 'edit' takes exactly one input image, got {len(prompt.files)}")
    if mode == "understand" and len(prompt.files) > 1:  # none: the text alone, as the reference's text-only turn
        raise InvalidArgument("files", f"mode 'understand' takes at most one input image, got {len(prompt.files)}")
    if not prompt.text.strip():
        raise InvalidArgument("text", "the prompt is empty")
    data: dict[str, Any] = {"kw": kw, "at": 0, "images": 0, "ids": [], "sent": "",
                            "seed": kw["seed"] if kw["seed"] is not None else random.getrandbits(63)}
    data["size"] = (kw["height"], kw["width"])
    context = 0
    if prompt.files:
        try:
            image = model.settings.vae_fit(decode_rgb(prompt.files[0].data))
        except ValueError as e:
            raise InvalidArgument("files[0].data", str(e)) from None
        data["size"] = (image.size[1], image.size[0])  # editing keeps the (fitted) input's size
        data["vae_pixels"] = to_uint8(image)
        data["vit_pixels"] = to_uint8(model.settings.vit_fit(image))
        vit_hw = data["vit_pixels"].shape[1:]
        context += (vit_hw[0] // 14) * (vit_hw[1] // 14) + 2
        if mode == "edit":
            down = cfg.vae.downsample
            data["eps_shape"] = (1, cfg.vae.z_channels, image.size[1] // down, image.size[0] // down)
            data["eps"] = draw_noise(data["seed"], 0, cfg.patch_latent_dim, data["eps_shape"])[0]
            context += (image.size[1] // cfg.latent_downsample) * (image.size[0] // cfg.latent_downsample) + 2
    h, w = (s // cfg.latent_downsample for s in data["size"])
    if mode != "understand" and max(h, w) > cfg.max_latent_size:  # understanding generates no image
        raise InvalidArgument("files[0]" if prompt.files else "model_kwargs.height",
                              f"the image is {data['size'][1]}x{data['size'][0]}; this checkpoint generates at most "
                              f"{cfg.max_image_side} pixels a side")
    data["blocks"] = plan(mode, kw["think"], kw["cfg_text"], kw["cfg_img"], prompt.text, image=bool(prompt.files))
    text = len(encode_ids(model._tokenizer, prompt.text, add_special_tokens=False)) + 2
    tail = kw["max_tokens"] if mode == "understand" else h * w + 2 + (kw["think_max_tokens"] + 64 if kw["think"] else 0)
    if text + context + tail > model.max_seq_len:
        raise InvalidArgument("text", f"the prompt ({text} tokens), the image ({context}) and what follows ({tail}) "
                                      f"exceed max_seq_len={model.max_seq_len}")
    return RequestState(prompt, data=data)


def noise(model, state: RequestState, index: int) -> torch.Tensor:
    """Image ``index``'s initial latent noise: seed + index, drawn after the posterior sample as
    the reference draws them."""
    d, cfg = state.data, model.config()
    h, w = (s // cfg.latent_downsample for s in d["size"])
    return draw_noise(d["seed"] + index, h * w, cfg.patch_latent_dim, d.get("eps_shape"))[1]


def text_output(model, state: RequestState, emit: Emit) -> list[Output]:
    """A decoded token -> the text it adds (held back while it ends in an incomplete character),
    cut as the reference cuts its reply."""
    from mstar.models.bagel.requests import think_text

    d = state.data
    token = int(emit.tensor.reshape(-1)[0])
    d["ids"].append(token)
    state.completion_tokens += 1
    block = d["blocks"][d["at"]]
    limit = d["kw"]["max_tokens" if block.kind == "decode" else "think_max_tokens"]
    if token != model.config().tokens.eos and len(d["ids"]) >= limit and block.kind == "decode":
        state.finish_reason = "length"
    text = think_text(model._tokenizer.decode(d["ids"], skip_special_tokens=False))
    if text.endswith("\ufffd") or not text.startswith(d["sent"]):
        return []
    delta, d["sent"] = text[len(d["sent"]):], text
    return [Output("text", Modality.TEXT, text=delta, token_ids=[token])] if delta else []


def image_output(state: RequestState, emit: Emit) -> list[Output]:
    return [Output("image", Modality.IMAGE, data=emit.tensor.cpu().numpy().tobytes(), mime_type="image/png")]
