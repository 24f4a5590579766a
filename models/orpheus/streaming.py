"""The official Orpheus streaming decode: a sliding window of 4 frames, advancing 1 frame.

`orpheus_tts/decoder.py::tokens_decoder`: after every 7th accepted code, once more than 27 are
buffered, it decodes the last 28 codes (frames f-3..f) and `convert_to_audio` keeps
`audio_hat[:, :, 2048:4096]`, i.e. the second frame (f-2) of the window. So frame 0 and the last two
frames of an utterance are never emitted (the official code has no flush), and each emitted frame
was decoded with 1 frame of left and 2 frames of right context. SNAC's decoder reaches up to
~2.5 frames (see `receptive_field_samples`), so the emitted samples are close to, not equal to,
those of one decode over the whole utterance; and each window decode draws its own noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .tokens import TOKENS_PER_FRAME, snac_codes

WINDOW_FRAMES = 4  # 28 codes decoded per step
KEEP_FRAME = 1  # window frame whose samples are emitted (2048:4096 at 2048 samples/frame)


@dataclass(frozen=True)
class StreamWindow:
    first_frame: int  # utterance frame index of the window's first frame
    codes: tuple[int, ...]  # WINDOW_FRAMES * 7 codes

    @property
    def emitted_frame(self) -> int:
        return self.first_frame + KEEP_FRAME


def stream_windows(codes: Sequence[int]) -> Iterator[StreamWindow]:
    """Windows in the order the official decoder forms them; a trailing partial frame is ignored
    (it is still being generated)."""
    num_frames = len(codes) // TOKENS_PER_FRAME
    for last in range(WINDOW_FRAMES - 1, num_frames):
        first = last - WINDOW_FRAMES + 1
        yield StreamWindow(first, tuple(codes[first * TOKENS_PER_FRAME : (last + 1) * TOKENS_PER_FRAME]))


def code_tensors(codes: Sequence[int], device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """7-per-frame codes -> snac's decode input: three int64 (1, T_i) tensors."""
    return [torch.tensor([level], dtype=torch.long, device=device) for level in snac_codes(codes).levels]


def decode_stream(
    decode: Callable[[list[torch.Tensor]], torch.Tensor], codes: Sequence[int], samples_per_frame: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(emitted frame index, (samples_per_frame,) float samples) per window, as Orpheus streams."""
    keep = slice(KEEP_FRAME * samples_per_frame, (KEEP_FRAME + 1) * samples_per_frame)
    for window in stream_windows(codes):
        audio = decode(code_tensors(window.codes))
        yield window.emitted_frame, audio[0, 0, keep]


def to_pcm16(samples: torch.Tensor) -> bytes:
    """Float samples in [-1, 1] -> little-endian int16 bytes, as the official decoder (x * 32767,
    truncated toward zero)."""
    return (samples.detach().cpu().float().numpy() * 32767).astype("<i2").tobytes()


def receptive_field_samples(decoder_rates: Sequence[int]) -> int:
    """One-sided reach, in output samples, of SNAC's decoder stack (k7 convs, transposed convs,
    residual units with dilations 1/3/9), an upper bound: an output sample depends only on latent
    steps within this distance, so samples at least this far from both edges of a decoded window
    come out as in a longer decode. 5050 for the 24 kHz rates [8, 8, 4, 2] (~2.5 frames)."""
    hop = math.prod(decoder_rates)
    reach = 3 * hop  # depthwise k7 conv on the latent
    rate = hop
    for stride in decoder_rates:
        reach += rate  # transposed conv (k = 2 * stride): one input step either side
        rate //= stride
        reach += 3 * (1 + 3 + 9) * rate  # three k7 residual convs, dilations 1, 3, 9
    return reach + 3  # final k7 conv at the output rate
