"""Camera images: encoded bytes (PNG, JPEG, anything Pillow reads) -> uint8 [3, S, S], resized to
S without distortion and padded with black, as openpi's ``resize_with_pad``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.untrusted import open_image

#: the most pixels a camera image may declare (a 4K frame has 8.3M). Checked from the header,
#: before decoding: a 2 MB JPEG of 12000 x 12000 would otherwise cost ~4 GB and seconds of the
#: conductor's CPU per camera (its RGB bytes, then float32 for the resize).
MAX_IMAGE_PIXELS = 4096 * 4096


def resize_with_pad(image: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 [3, h, w] -> uint8 [3, size, size]: bilinear resize keeping the aspect ratio, then zero
    padding split evenly (the odd pixel after)."""
    _, h, w = image.shape
    if (h, w) == (size, size):
        return image
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    resized = F.interpolate(image[None].float(), size=(rh, rw), mode="bilinear", align_corners=False)[0]
    resized = resized.round().clamp(0, 255).to(torch.uint8)
    top, left = (size - rh) // 2, (size - rw) // 2
    return F.pad(resized, (left, size - rw - left, top, size - rh - top))


def decode_image(data: bytes, size: int) -> torch.Tensor:
    """Raises ValueError saying why when ``data`` is not an image."""
    try:
        import PIL  # noqa: F401
    except ImportError as e:  # pragma: no cover - an install without the pi05 extra
        raise ValueError("decoding images needs Pillow (pip install 'mstar[pi05]')") from e
    with open_image(data, MAX_IMAGE_PIXELS) as img:
        rgb = img.convert("RGB")
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(rgb.height, rgb.width, 3)
    return resize_with_pad(pixels.permute(2, 0, 1).contiguous(), size)
