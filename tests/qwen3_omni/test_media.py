"""Conductor-side media decoding: what the encoders receive."""

import io

import numpy as np
import pytest
import torch
from test_serving import mp3_bytes, mp4_bytes, png_bytes, wav_bytes

from mstar.models.base import InputFile, InvalidArgument
from mstar.models.qwen3_omni.audio import output_lengths
from mstar.models.qwen3_omni.media import MediaDecoder

from helpers import forbid_video_decoding


@pytest.fixture()
def media(parts):
    return MediaDecoder(parts.cfg, parts.reader.directory, 10.0, 1280 * 28 * 28 * 4, 1 << 26, max_video_seconds=10.0)


def test_audio_image_video_in_order(media, parts):
    m = media.decode([InputFile("a.wav", "audio/wav", wav_bytes(1.3)), InputFile("b.png", "image/png", png_bytes()),
                      InputFile("c.mp4", "video/mp4", mp4_bytes(frames=6, fps=4))])
    assert m.audio_lengths == [130] and m.audio_rows == [int(output_lengths(torch.tensor(130)))]  # 100 mel frames a second
    assert m.audio_features.shape == (parts.cfg.audio.num_mel_bins, 130)
    v = parts.cfg.vision
    (t, h, w), (vt, vh, vw) = m.grids[0], m.video_grids[0]
    assert t == 1 and vt == 2  # 1.5 s at 2 fps: 3 frames, the last repeated into a second temporal patch
    assert m.video_seconds == [v.temporal_patch_size / 2.0]
    assert m.pixels.shape == (h * w + vt * vh * vw, v.in_channels * v.temporal_patch_size * v.patch_size**2)
    assert m.image_rows == [h * w // 4] and m.video_rows == [vt * vh * vw // 4]


def test_video_patches_pair_consecutive_frames(media, parts):
    """Temporal patch g holds frames 2g and 2g+1 on its temporal axis, each as the image processor
    makes that frame alone (the Qwen2-VL video layout)."""
    data = mp4_bytes(frames=8, fps=2)  # 4 s at 2 fps: frames are the video's own
    frames = media._frames(data, "files[0]")
    px, (gt, gh, gw) = media._video(data, "files[0]")
    v = parts.cfg.vision
    grouped = px.view(gt, gh * gw, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    ip = media._processor(min(media.max_pixels, 256 * 32 * 32))
    for k, frame in enumerate(frames):
        still = ip(images=[frame], return_tensors="pt")["pixel_values"].view(gh * gw, v.in_channels, v.temporal_patch_size,
                                                                              v.patch_size, v.patch_size)[:, :, 0]
        assert torch.equal(grouped[k // 2, :, :, k % 2], still)


def test_mp3_decodes_to_the_tone_it_holds(media):
    """A 1.3 s 440 Hz tone at 44.1 kHz as MP3 -> 1.3 s at 16 kHz (LAME's padding trimmed), its
    spectrum's peak at 440 Hz, its RMS that of a 0.3 sine within 5%; the features those samples
    make; with no content type the name says MP3."""
    data = mp3_bytes(1.3)
    x = media._mp3(data, "files[0]")
    assert abs(x.size / 16000 - 1.3) < 0.03
    assert np.argmax(np.abs(np.fft.rfft(x))) * 16000 / x.size == pytest.approx(440, abs=2)
    assert np.sqrt((x**2).mean()) == pytest.approx(0.3 / np.sqrt(2), rel=0.05)
    for f in (InputFile("a.mp3", "audio/mpeg", data), InputFile("a.mp3", "", data)):
        m = media.decode([f])
        assert torch.equal(m.audio_features, media._features(x)) and m.audio_lengths == [m.audio_features.shape[1]]


@pytest.mark.parametrize("name,kind,data,why", [
    ("long.mp3", "audio/mpeg", mp3_bytes(12.0), "audio longer than 10 s"),
    ("x.mp3", "audio/mpeg", b"ID3\x03 not really an mp3", "not a readable MP3 file"),
    ("long.mp4", "video/mp4", mp4_bytes(frames=48, fps=4), "video longer than 10 s"),
    ("long.wav", "audio/wav", wav_bytes(12.0, rate=8000), "audio of 12.0 s"),
    ("x.mp4", "video/mp4", b"not a video", "not a readable video"),
    ("x.bin", "", b"?", "content type"),
    ("huge.jpg", "image/jpeg", None, "image of 8192x8193 pixels; at most 67108864 pixels"),  # refused from its header
])
def test_bad_media_names_the_file(media, name, kind, data, why):
    if data is None:
        from PIL import Image

        buf = io.BytesIO()
        Image.new("L", (8192, 8193)).save(buf, format="JPEG", quality=10)
        data = buf.getvalue()
    with pytest.raises(InvalidArgument) as e:
        media.decode([InputFile("ok.png", "image/png", png_bytes()), InputFile(name, kind, data)])
    assert e.value.field == "files[1]" and why in e.value.description
    assert "files[" not in e.value.description  # one message, not one wrapped in another


def test_video_frames_past_the_pixel_limit_are_refused_before_decoding(media, monkeypatch):
    """A video's frame size comes from its header: past MAX_INPUT_PIXELS (here lowered to 64x47)
    the file is refused before any frame is decoded; at the limit it decodes as before."""
    from mstar.models.qwen3_omni import media as media_module

    data = mp4_bytes(frames=4, w=64, h=48)
    monkeypatch.setattr(media_module, "MAX_INPUT_PIXELS", 64 * 47)
    with monkeypatch.context() as m:
        forbid_video_decoding(m)
        with pytest.raises(InvalidArgument) as e:
            media.decode([InputFile("clip.mp4", "video/mp4", data)])
    assert e.value.field == "files[0]" and "video frames of 64x48 pixels; at most 3008 pixels" in e.value.description
    monkeypatch.setattr(media_module, "MAX_INPUT_PIXELS", 64 * 48)
    assert media.decode([InputFile("clip.mp4", "video/mp4", data)]).video_grids  # the same clip at the limit


@pytest.mark.parametrize("limit,value", [("MAX_DECODED_FRAMES", 3), ("MAX_DECODED_PIXELS", 64 * 48 * 3)])
def test_the_decoding_a_video_may_cost_is_bounded(media, monkeypatch, limit, value):
    """Frames read through count, kept or not: a 4-frame clip past a 3-frame (or 3-frames-of-pixels)
    budget is refused as it decodes; at 4 it passes."""
    from mstar.models.qwen3_omni import media as media_module

    data = mp4_bytes(frames=4, fps=4)
    monkeypatch.setattr(media_module, limit, value)
    with pytest.raises(InvalidArgument) as e:
        media.decode([InputFile("clip.mp4", "video/mp4", data)])
    assert e.value.field == "files[0]" and "the video decodes to more than" in e.value.description
    monkeypatch.setattr(media_module, limit, value // 3 * 4)
    assert media.decode([InputFile("clip.mp4", "video/mp4", data)]).video_grids
