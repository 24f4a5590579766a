"""Media inputs, decoded on the conductor with size limits: WAV or MP3 audio (MP3 through PyAV) -> 16 kHz log-mel features
(Whisper's, as the checkpoint's processor makes them); PNG/JPEG images -> patch rows and their
grid (Qwen2-VL's image processor with the checkpoint's patch and merge sizes); videos (mp4, webm...
through PyAV) -> frames sampled at ``VIDEO_FPS``, each resized and normalised by the same image
processor, consecutive pairs stacked into temporal patches (the Qwen2-VL video layout).
transformers' feature extractor and image processor do the numerics; everything here is checking
and plumbing. A bad file is INVALID_ARGUMENT naming ``files[i]``.
"""

from __future__ import annotations

import io
import json
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mstar.limits import MAX_INPUT_PIXELS
from mstar.models.base import InputFile, InvalidArgument
from mstar.models.qwen3_omni.audio import output_lengths
from mstar.models.qwen3_omni.config import OmniConfig
from mstar.untrusted import Untrusted, open_image

SAMPLE_RATE = 16_000
VIDEO_FPS = 2.0  # frames sampled per second of video (Qwen's default)
MAX_VIDEO_FRAMES = 256
VIDEO_FRAME_PIXELS = 256 * 32 * 32  # per frame, after resizing (before temporal pairing)
#: the decoding a video may cost, kept frames or not: frames, and pixels over all of them (two minutes
#: of 1080p at 30 fps fit); a tiny file can declare a high frame rate of large, static frames
MAX_DECODED_FRAMES = 4096
MAX_DECODED_PIXELS = MAX_DECODED_FRAMES * 1920 * 1080


@dataclass
class Media:
    audio_features: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))  # [mel, frames of all audios]
    audio_lengths: list[int] = field(default_factory=list)  # mel frames per audio
    audio_rows: list[int] = field(default_factory=list)  # encoder rows (placeholders) per audio
    pixels: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))  # [patches, C*T*P*P]: images, then videos
    grids: list[list[int]] = field(default_factory=list)  # (t, h, w) patches per image
    image_rows: list[int] = field(default_factory=list)  # merged tokens (placeholders) per image
    video_grids: list[list[int]] = field(default_factory=list)  # (t, h, w) patches per video
    video_rows: list[int] = field(default_factory=list)
    video_seconds: list[float] = field(default_factory=list)  # seconds per temporal patch

    @property
    def empty(self) -> bool:
        return not self.audio_lengths and not self.grids and not self.video_grids


class MediaDecoder:
    def __init__(self, cfg: OmniConfig, checkpoint: Path, max_audio_seconds: float, max_image_pixels: int,
                 max_file_bytes: int, max_video_seconds: float = 120.0):
        self.cfg, self.dir = cfg, checkpoint
        self.max_audio_s, self.max_pixels, self.max_bytes = max_audio_seconds, max_image_pixels, max_file_bytes
        self.max_video_s = max_video_seconds
        self._fe = None
        self._ip = None

    def decode(self, files: list[InputFile]) -> Media:
        m = Media()
        feats: list[torch.Tensor] = []
        pixels: list[torch.Tensor] = []
        video_pixels: list[torch.Tensor] = []
        for i, f in enumerate(files):
            where = f"files[{i}]"
            if len(f.data) > self.max_bytes:
                raise InvalidArgument(where, f"{len(f.data)} bytes; at most {self.max_bytes}")
            kind = f.content_type.split("/")[0] if f.content_type else _guess(f.name)
            if kind == "audio":
                x = self._features(self._mp3(f.data, where) if _is_mp3(f) else self._wav(f.data, where))
                feats.append(x)
                m.audio_lengths.append(x.shape[1])
                m.audio_rows.append(int(output_lengths(torch.tensor(x.shape[1]), self.cfg.audio.n_window)))
            elif kind == "image":
                px, grid = self._image(f.data, where)
                pixels.append(px)
                m.grids.append(grid)
                m.image_rows.append(grid[0] * grid[1] * grid[2] // self.cfg.vision.spatial_merge_size**2)
            elif kind == "video":
                px, grid = self._video(f.data, where)
                video_pixels.append(px)
                m.video_grids.append(grid)
                m.video_rows.append(grid[0] * grid[1] * grid[2] // self.cfg.vision.spatial_merge_size**2)
                m.video_seconds.append(self.cfg.vision.temporal_patch_size / VIDEO_FPS)
            else:
                raise InvalidArgument(where, f"content type {f.content_type or '(none)'!r}: send audio/wav, audio/mpeg, "
                                             "image/png, image/jpeg or a video (video/mp4, video/webm)")
        if feats:
            m.audio_features = torch.cat(feats, dim=1)
        if pixels or video_pixels:
            m.pixels = torch.cat(pixels + video_pixels)
        return m

    def _wav(self, data: bytes, where: str) -> np.ndarray:
        try:
            with wave.open(io.BytesIO(data)) as w:
                rate, channels, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
                raw = w.readframes(n)
        except (wave.Error, EOFError) as e:
            raise InvalidArgument(where, f"not a readable WAV file ({e})") from None
        if width not in (1, 2, 4) or rate <= 0 or channels <= 0:
            raise InvalidArgument(where, f"unsupported WAV: {width * 8}-bit, {rate} Hz, {channels} channels")
        if n == 0:
            raise InvalidArgument(where, "the audio is empty")
        if n / rate > self.max_audio_s:
            raise InvalidArgument(where, f"audio of {n / rate:.1f} s; at most {self.max_audio_s:g} s")
        dtype = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
        x = np.frombuffer(raw, dtype=dtype).astype(np.float32)
        x = (x - 128) / 128 if width == 1 else x / float(2 ** (8 * width - 1))
        x = x.reshape(-1, channels).mean(1)
        if rate != SAMPLE_RATE:  # linear resampling (the reference processor uses librosa's)
            t = np.arange(int(len(x) * SAMPLE_RATE / rate)) * (rate / SAMPLE_RATE)
            x = np.interp(t, np.arange(len(x)), x).astype(np.float32)
        return x

    def _mp3(self, data: bytes, where: str) -> np.ndarray:
        """MP3 -> 16 kHz mono float samples (PyAV: FFmpeg's decoder and resampler). The decode stops
        as soon as the audio passes ``max_audio_s``, whatever the header claims."""
        try:
            import av
        except ImportError:
            raise InvalidArgument(where, "MP3 input needs PyAV on the conductor (pip install av); or send WAV") from None
        limit = int(self.max_audio_s * SAMPLE_RATE)
        chunks: list[np.ndarray] = []
        n = 0

        def take(frames) -> None:
            nonlocal n
            for out in frames:
                chunks.append(out.to_ndarray().reshape(-1))
                n += chunks[-1].size
            if n > limit:
                raise InvalidArgument(where, f"audio longer than {self.max_audio_s:g} s")

        try:
            with av.open(io.BytesIO(data), format="mp3") as container:
                stream = container.streams.audio[0]
                resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
                for frame in container.decode(stream):
                    take(resampler.resample(frame))
                take(resampler.resample(None))  # the resampler's tail
        except InvalidArgument:
            raise
        except (av.error.FFmpegError, IndexError, ValueError) as e:
            raise InvalidArgument(where, f"not a readable MP3 file ({e})") from None
        if not chunks:
            raise InvalidArgument(where, "the audio is empty")
        return np.concatenate(chunks).astype(np.float32)

    def _features(self, samples: np.ndarray) -> torch.Tensor:
        if self._fe is None:
            from transformers import WhisperFeatureExtractor

            self._fe = WhisperFeatureExtractor(feature_size=self.cfg.audio.num_mel_bins, sampling_rate=SAMPLE_RATE)
        out = self._fe(samples, sampling_rate=SAMPLE_RATE, return_tensors="pt", padding="longest", truncation=False,
                       return_attention_mask=True)
        n = int(out["attention_mask"].sum())
        return out["input_features"][0, :, :n].float()

    def _image(self, data: bytes, where: str) -> tuple[torch.Tensor, list[int]]:
        try:
            img = open_image(data, MAX_INPUT_PIXELS).convert("RGB")
        except Untrusted as e:
            raise InvalidArgument(where, str(e)) from None
        out = self._processor(self.max_pixels)(images=[img], return_tensors="pt")
        return out["pixel_values"].float(), [int(x) for x in out["image_grid_thw"][0].tolist()]

    def _processor(self, max_pixels: int):
        """Qwen2-VL's image processor (PIL backend) with the checkpoint's sizes and statistics."""
        if self._ip is None:
            self._ip = {}
        if max_pixels not in self._ip:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            v = self.cfg.vision
            kw = {"patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
                  "merge_size": v.spatial_merge_size, "max_pixels": max_pixels}
            pre = self.dir / "preprocessor_config.json"
            if pre.is_file():
                saved = json.loads(pre.read_text())
                kw |= {k: saved[k] for k in ("image_mean", "image_std", "min_pixels") if k in saved}
            self._ip[max_pixels] = Qwen2VLImageProcessorPil(**kw)
        return self._ip[max_pixels]

    def _video(self, data: bytes, where: str) -> tuple[torch.Tensor, list[int]]:
        v = self.cfg.vision
        ip = self._processor(min(self.max_pixels, VIDEO_FRAME_PIXELS))
        per = []
        # each frame as a still, as it is decoded (one full-size frame in memory at a time): patch
        # rows [N, C, tp, p, p] with the frame tiled over tp
        for img in self._frames(data, where):
            out = ip(images=[img], return_tensors="pt")
            grid = [int(x) for x in out["image_grid_thw"][0].tolist()]
            per.append(out["pixel_values"].float().view(-1, v.in_channels, v.temporal_patch_size, v.patch_size,
                                                         v.patch_size)[:, :, 0])
        tp = v.temporal_patch_size
        while len(per) % tp:
            per.append(per[-1])  # the last frame repeated up to a whole temporal patch, as Qwen pads
        groups = [torch.stack(per[i : i + tp], dim=2) for i in range(0, len(per), tp)]  # [N, C, tp, p, p]
        pixels = torch.cat([g.reshape(g.shape[0], -1) for g in groups])
        return pixels, [len(groups), grid[1], grid[2]]

    def _frames(self, data: bytes, where: str):
        """The video's frames at VIDEO_FPS as RGB images, one at a time. Frame sizes past
        MAX_INPUT_PIXELS are refused from the stream's header, before any frame is decoded."""
        try:
            import av
        except ImportError:
            raise InvalidArgument(where, "video input needs PyAV on the conductor (pip install av)") from None
        kept = decoded = pixels = 0
        try:
            with av.open(io.BytesIO(data)) as container:
                stream = container.streams.video[0]
                _check_pixels(stream.codec_context.width, stream.codec_context.height, where, "video frames")
                next_t = 0.0
                for frame in container.decode(stream):
                    _check_pixels(frame.width, frame.height, where, "video frames")  # a size may change midway
                    decoded, pixels = decoded + 1, pixels + frame.width * frame.height
                    if decoded > MAX_DECODED_FRAMES or pixels > MAX_DECODED_PIXELS:
                        raise InvalidArgument(where, f"the video decodes to more than {MAX_DECODED_FRAMES} frames or "
                                                     f"{MAX_DECODED_PIXELS} pixels in all; send a shorter clip or a "
                                                     "lower frame rate or size")
                    t = float(frame.time) if frame.time is not None else kept / VIDEO_FPS
                    if t > self.max_video_s:
                        raise InvalidArgument(where, f"video longer than {self.max_video_s:g} s")
                    if t + 1e-6 >= next_t:
                        kept += 1
                        if kept > MAX_VIDEO_FRAMES:
                            raise InvalidArgument(where, f"more than {MAX_VIDEO_FRAMES} frames at {VIDEO_FPS:g} fps")
                        next_t += 1.0 / VIDEO_FPS
                        yield frame.to_image()  # RGB
        except InvalidArgument:  # (a ValueError: the limits above, not an unreadable file)
            raise
        except (av.error.FFmpegError, IndexError, ValueError) as e:
            raise InvalidArgument(where, f"not a readable video ({e})") from None
        if not kept:
            raise InvalidArgument(where, "the video has no frames")


def _check_pixels(width: int, height: int, where: str, what: str) -> None:
    if width * height > MAX_INPUT_PIXELS:
        raise InvalidArgument(where, f"{what} of {width}x{height} pixels; at most {MAX_INPUT_PIXELS} pixels")


def _is_mp3(f: InputFile) -> bool:
    """By its content type (audio/mpeg, audio/mp3) or, without one, its name."""
    if f.content_type:
        return f.content_type.lower() in ("audio/mpeg", "audio/mp3")
    return f.name.lower().endswith(".mp3")


def _guess(name: str) -> str:
    ext = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    return {"wav": "audio", "mp3": "audio", "png": "image", "jpg": "image", "jpeg": "image", "mp4": "video", "webm": "video",
            "mkv": "video", "mov": "video"}.get(ext, "")
