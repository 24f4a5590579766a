"""``untrusted.open_image``, the one bounded image open of BAGEL's, Qwen3-Omni's and π0.5's
inputs: the size a header declares is refused before any pixel is decoded, a header past
Pillow's own bound (which Pillow refuses with an error of its own, not an OSError) is refused as
too large, and a file that does not decode says so. Each is an ``Untrusted`` (a ValueError)."""

import io

import pytest

from mstar.untrusted import Untrusted, open_image

Image = pytest.importorskip("PIL.Image", reason="images need Pillow")


def png(size, mode="L") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def test_an_image_within_the_bound_opens_decoded():
    img = open_image(png((40, 30)), 40 * 30)
    assert img.size == (40, 30) and img.getpixel((0, 0)) == 0


def test_a_declared_size_past_the_bound_is_refused_before_decoding(monkeypatch):
    data = png((40, 30))

    def no_decode(*a, **k):
        raise AssertionError("decoded")
    monkeypatch.setattr(Image.Image, "load", no_decode)
    monkeypatch.setattr("PIL.ImageFile.ImageFile.load", no_decode)
    with pytest.raises(Untrusted, match=r"an image of 40x30 pixels; at most 1199 pixels"):
        open_image(data, 40 * 30 - 1)


def test_past_pillows_own_bound_is_too_large_not_unreadable(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow refuses twice this from the header
    with pytest.raises(Untrusted, match=r"an image too large to decode \(Image size \(1200 pixels\)"):
        open_image(png((40, 30)), 10**6)


@pytest.mark.parametrize("data,why", [(b"hello", "UnidentifiedImageError"), (png((64, 64))[:60], "")])
def test_what_does_not_decode_says_so(data, why):
    with pytest.raises(Untrusted, match=f"not a decodable image \\({why}"):
        open_image(data, 10**6)
