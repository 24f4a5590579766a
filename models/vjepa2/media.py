"""Request files -> frames the encoder takes, on the conductor (bounded: bytes, frames, pixels).

Accepted: a video (mp4 / webm / mkv / mov, decoded with PyAV when it is installed: ``pip install
av``), an image (png / jpeg, also through PyAV), or raw frames as ``.npy`` / ``.safetensors``
(one tensor): uint8 ``[T, H, W, 3]`` or ``[H, W, 3]`` (resized here), or float ``[T, 3, crop, crop]``
already normalised (taken as is).

uint8 frames are resized (bilinear, antialiased) so the short side is ``short_side``, centre-cropped
to ``crop`` and sent as uint8 ``[T, crop, crop, 3]`` (a quarter of float32 on the wire); the encoder
node scales and ImageNet-normalises them on its device. Clips use the reference's eval transform
(short side 256/224 of the crop); robot frames for the AC walks the full-frame square (short side = crop).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from mstar.models.base import InputFile, InvalidArgument

IMAGE_EXT = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 64 << 20  # a file
    max_frames: int = 64  # frames kept (after frame_step)
    max_pixels: int = 4096 * 4096  # per decoded frame
    max_decoded: int = 2048  # frames a video may be read through, kept or not
    max_decoded_pixels: int = 2048 * 1920 * 1080  # over every frame read through, kept or not


def _kind(f: InputFile) -> str:
    """By name or content type, else by content (a REST file part is named by its form field and
    often typed application/octet-stream): npy's magic, a safetensors JSON header, else a video."""
    name, ct = f.name.lower(), f.content_type.lower()
    if name.endswith(".npy") or ct in ("application/x-npy", "application/npy") or f.data[:6] == b"\x93NUMPY":
        return "npy"
    if name.endswith(".safetensors") or ct == "application/x-safetensors" or _looks_safetensors(f.data):
        return "safetensors"
    if name.endswith(IMAGE_EXT) or ct.startswith("image/"):
        return "image"
    return "video"  # PyAV says whether it is one


def _looks_safetensors(data: bytes) -> bool:
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    return 0 < n <= len(data) - 8 and data[8:9] == b"{"


def _decode_av(f: InputFile, field: str, step: int, limits: Limits) -> np.ndarray:
    try:
        import av
    except ImportError:
        raise InvalidArgument(field, "this server cannot decode video (PyAV is not installed); send raw frames as "
                                     ".npy or .safetensors (uint8 [T, H, W, 3])") from None
    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(f.data), mode="r") as container:
            if not container.streams.video:
                raise InvalidArgument(field, "has no video stream")
            def check(width: int, height: int) -> None:
                if width * height > limits.max_pixels:
                    raise InvalidArgument(field, f"frames of {width}x{height} exceed {limits.max_pixels} pixels")

            ctx = container.streams.video[0].codec_context
            check(ctx.width, ctx.height)  # the header's size: refused before any frame is decoded
            pixels = 0
            for i, frame in enumerate(container.decode(video=0)):
                if i >= limits.max_decoded:
                    raise InvalidArgument(field, f"video is longer than {limits.max_decoded} frames")
                check(frame.width, frame.height)
                pixels += frame.width * frame.height
                if pixels > limits.max_decoded_pixels:
                    raise InvalidArgument(field, f"the video decodes to more than {limits.max_decoded_pixels} pixels "
                                                 "in all; send a shorter clip or smaller frames")
                if i % step == 0:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    if len(frames) > limits.max_frames:
                        break
    except InvalidArgument:
        raise
    except Exception as e:  # av.error.*: anything the demuxer or decoder refuses
        raise InvalidArgument(field, f"does not decode as video/image ({type(e).__name__}: {e})") from None
    if not frames:
        raise InvalidArgument(field, "decoded to no frames")
    return np.stack(frames)


def _tensor_file(f: InputFile, kind: str, field: str) -> np.ndarray:
    try:
        if kind == "npy":
            return np.load(io.BytesIO(f.data), allow_pickle=False)
        from safetensors.numpy import load

        tensors = load(f.data)
    except Exception as e:
        raise InvalidArgument(field, f"not a readable {kind} file ({type(e).__name__}: {e})") from None
    if len(tensors) != 1:
        raise InvalidArgument(field, f"a .safetensors file must hold one tensor, got {sorted(tensors)}")
    return next(iter(tensors.values()))


def resize_crop(frames: torch.Tensor, short_side: int, crop: int) -> torch.Tensor:
    """uint8 ``[T, H, W, 3]`` -> uint8 ``[T, crop, crop, 3]``."""
    x = frames.permute(0, 3, 1, 2).float()
    h, w = x.shape[-2:]
    scale = short_side / min(h, w)
    size = (max(crop, round(h * scale)), max(crop, round(w * scale)))
    if size != (h, w):
        x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    top, left = (size[0] - crop) // 2, (size[1] - crop) // 2
    x = x[..., top:top + crop, left:left + crop]
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def load_frames(f: InputFile, field: str, crop: int, short_side: int, step: int = 1, limits: Limits = Limits(),
                ) -> torch.Tensor:
    """uint8 ``[T, crop, crop, 3]`` or float32 ``[T, 3, crop, crop]`` (already normalised)."""
    if len(f.data) > limits.max_bytes:
        raise InvalidArgument(field, f"{len(f.data)} bytes; at most {limits.max_bytes}")
    kind = _kind(f)
    if kind in ("video", "image"):
        arr = _decode_av(f, field, step, limits)
    else:
        arr = _tensor_file(f, kind, field)
        if arr.ndim == 3:
            arr = arr[None]
        arr = arr[::step]
    if arr.ndim != 4:
        raise InvalidArgument(field, f"frames must be [T, H, W, 3] uint8 or [T, 3, H, W] float, got shape {list(arr.shape)}")
    if arr.shape[0] > limits.max_frames:
        raise InvalidArgument(field, f"more than {limits.max_frames} frames; trim the clip or raise "
                                     f"model_kwargs.frame_step")
    if arr.dtype == np.uint8:
        if arr.shape[-1] != 3:
            raise InvalidArgument(field, f"uint8 frames must be [T, H, W, 3] (RGB), got {list(arr.shape)}")
        if arr.shape[1] * arr.shape[2] > limits.max_pixels:
            raise InvalidArgument(field, f"frames of {arr.shape[2]}x{arr.shape[1]} exceed {limits.max_pixels} pixels")
        return resize_crop(torch.from_numpy(np.ascontiguousarray(arr)), short_side, crop)
    if arr.dtype in (np.float32, np.float16, np.float64):
        if tuple(arr.shape[1:]) != (3, crop, crop):
            raise InvalidArgument(field, f"float frames must be normalised [T, 3, {crop}, {crop}], got {list(arr.shape)}")
        t = torch.from_numpy(np.ascontiguousarray(arr)).float()
        if not torch.isfinite(t).all():
            raise InvalidArgument(field, "frames hold NaN or infinity")
        return t
    raise InvalidArgument(field, f"frames of dtype {arr.dtype}; send uint8 or float32")


def normalize(frames: torch.Tensor, device, dtype) -> torch.Tensor:
    """What ``load_frames`` made -> normalised float ``[T, 3, crop, crop]`` on ``device``."""
    from mstar.models.vjepa2.config import IMAGENET_MEAN, IMAGENET_STD

    if frames.dtype != torch.uint8:
        return frames.to(device=device, dtype=dtype)
    x = frames.to(device).permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
    return ((x - mean) / std).to(dtype)
