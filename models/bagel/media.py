"""Input images as the reference prepares them: RGB (transparency over white), resized so the long
side is at most ``max_size``, the short side at least ``min_size``, both multiples of ``stride`` and
the area at most ``max_pixels`` (bicubic), then to [-1, 1] on the node. Editing and understanding
first fit the image to the VAE's limits; the ViT sees that image fitted again to its own."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch

from mstar.limits import MAX_INPUT_PIXELS  # larger uploads are refused before decoding
from mstar.untrusted import open_image


@dataclass(frozen=True)
class Fit:
    max_size: int
    min_size: int
    stride: int
    max_pixels: int = 14 * 14 * 9 * 1024

    def _divisible(self, value: float) -> int:
        return max(self.stride, int(round(value / self.stride) * self.stride))

    def _scaled(self, w: int, h: int, scale: float) -> tuple[int, int]:
        return self._divisible(round(w * scale)), self._divisible(round(h * scale))

    def size(self, w: int, h: int) -> tuple[int, int]:
        """(width, height) an image of w x h is resized to."""
        scale = max(min(self.max_size / max(w, h), 1.0), self.min_size / min(w, h))
        nw, nh = self._scaled(w, h, scale)
        if nw * nh > self.max_pixels:
            nw, nh = self._scaled(nw, nh, self.max_pixels / (nw * nh))
        if max(nw, nh) > self.max_size:
            nw, nh = self._scaled(nw, nh, self.max_size / max(nw, nh))
        return nw, nh

    def __call__(self, image):
        from PIL import Image

        w, h = self.size(*image.size)
        return image.resize((w, h), Image.BICUBIC)


VAE_FIT = Fit(1024, 512, 16)
VIT_FIT = Fit(980, 224, 14)


def decode_rgb(data: bytes):
    """Bytes -> an RGB PIL image (transparent pixels over white). ValueError if unreadable."""
    from PIL import Image

    image = open_image(data, MAX_INPUT_PIXELS)
    if image.mode == "RGBA" or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.split()[3])
        return white
    return image.convert("RGB")


def to_uint8(image) -> torch.Tensor:
    """PIL RGB -> uint8 [3, H, W] (what travels to the encoder nodes)."""
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def normalize(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3, H, W] -> float32 in [-1, 1], the same operations as ToTensor + Normalize(0.5, 0.5)."""
    return (pixels.float().div(255) - 0.5) / 0.5


def encode_png(pixels: torch.Tensor) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.cpu().numpy()).save(buf, format="PNG")
    return buf.getvalue()
