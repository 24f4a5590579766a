"""The Orpheus sliding-window decode against one decode of the whole utterance.

Noise is off on both sides (`noise=False`): with noise on every decode draws fresh randn of its own
length, so window and whole decode differ by the noise term too and are not comparable sample by
sample. What is compared is the effect of the window's edges (zero padding in every conv layer).

Measured on the tiny random 24 kHz-rate SNAC of `reference_snac` (4 code seeds x 7 windows): the
emitted frame (samples 2048:4096 of a 4-frame window) deviates from the whole decode by at most
0.013 abs (signal peak ~0.25, RMS ~0.094), <= 2.0 % relative RMS per frame; the window's first and
last 512 samples deviate by ~0.08 and ~0.12. Asserted: <= 0.03 abs, <= 4 % relative RMS, edges
> 5x the kept frame's error. Samples farther than `receptive_field_samples` (5050, an upper
bound; measured reach 4715) from both window edges match to <= 3e-7 (asserted 1e-5). With noise on,
window and whole differ by up to ~0.6 here: the noise is a different draw per decode.
"""

import pytest
import torch

from mstar.models.orpheus.snac import load_snac_decoder
from mstar.models.orpheus.streaming import (
    code_tensors,
    decode_stream,
    receptive_field_samples,
    stream_windows,
    to_pcm16,
)
from mstar.models.orpheus.tokens import FIRST_WINDOW_CODES

SPF = 2048  # samples per frame at 24 kHz rates
STREAM_MAX_ABS = 0.03
STREAM_MAX_REL_RMS = 0.04
INTERIOR_ATOL = 1e-5


def official_windows(codes):
    """orpheus_tts/decoder.py::tokens_decoder's trigger, transcribed: decode buffer[-28:] whenever
    count % 7 == 0 and count > 27."""
    out, buffer = [], []
    for code in codes:
        buffer.append(code)
        count = len(buffer)
        if count % 7 == 0 and count > 27:
            out.append(tuple(buffer[-28:]))
    return out


@pytest.fixture(scope="module")
def decoder(reference_snac):
    return load_snac_decoder(reference_snac[1])


def random_frame_codes(frames, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (frames * 7,), generator=g).tolist()


@pytest.mark.parametrize("n_codes", [0, 27, 28, 34, 35, 70, 76])
def test_windows_match_the_official_trigger(n_codes):
    codes = list(range(n_codes))
    windows = list(stream_windows(codes))
    assert [w.codes for w in windows] == official_windows(codes)
    assert [w.emitted_frame for w in windows] == list(range(1, n_codes // 7 - 2))


@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_frames_are_close_to_the_whole_decode(decoder, seed):
    frames = 10
    codes = random_frame_codes(frames, seed)
    whole = decoder.decode(code_tensors(codes), noise=False)[0, 0]
    emitted = list(decode_stream(lambda c: decoder.decode(c, noise=False), codes, SPF))
    assert [f for f, _ in emitted] == list(range(1, frames - 2))
    for frame, samples in emitted:
        ref = whole[frame * SPF : (frame + 1) * SPF]
        err = samples - ref
        assert err.abs().max() <= STREAM_MAX_ABS, frame
        assert err.pow(2).mean().sqrt() <= STREAM_MAX_REL_RMS * ref.pow(2).mean().sqrt(), frame
    # Why the official decoder keeps 2048:4096: the window's own edges are far off.
    first = 4
    window = decoder.decode(code_tensors(codes[first * 7 : (first + 4) * 7]), noise=False)[0, 0]
    err = (window - whole[first * SPF : (first + 4) * SPF]).abs()
    kept = err[SPF : 2 * SPF].max()
    assert err[:512].max() > 5 * kept and err[-512:].max() > 5 * kept


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_frame_zero_from_the_three_frame_first_window_is_as_close(decoder, seed):
    """M* emits frame 0 from the first 21 codes (the first window of the served sliding window):
    frame 0 then has the same two frames of right context as every frame a full window emits
    (and no left edge to differ at). Measured: <= 1.5e-4 abs, <= 0.013 % relative RMS off the whole
    decode (the full window's frame 1: 0.013 abs, 2 %); asserted 10x the abs headroom."""
    codes = random_frame_codes(10, seed)
    whole = decoder.decode(code_tensors(codes), noise=False)[0, 0]
    first = decoder.decode(code_tensors(codes[:FIRST_WINDOW_CODES]), noise=False)[0, 0]
    assert first.shape[0] == 3 * SPF
    ref, err = whole[:SPF], first[:SPF] - whole[:SPF]
    assert err.abs().max() <= STREAM_MAX_ABS / 10
    assert err.pow(2).mean().sqrt() <= STREAM_MAX_REL_RMS / 10 * ref.pow(2).mean().sqrt()


def test_interior_beyond_the_receptive_field_matches_exactly(decoder):
    reach = receptive_field_samples([8, 8, 4, 2])
    codes = random_frame_codes(12, seed=2)
    whole = decoder.decode(code_tensors(codes), noise=False)[0, 0]
    first, width = 2, 8  # 16384 samples: interior of 6284 samples beyond `reach` from both edges
    window = decoder.decode(code_tensors(codes[first * 7 : (first + width) * 7]), noise=False)[0, 0]
    ref = whole[first * SPF : (first + width) * SPF]
    torch.testing.assert_close(window[reach:-reach], ref[reach:-reach], atol=INTERIOR_ATOL, rtol=0)
    assert (window[:reach] - ref[:reach]).abs().max() > 100 * INTERIOR_ATOL  # the edge really differs


def test_receptive_field_bounds_the_reach_of_one_latent_step(decoder):
    reach = receptive_field_samples([8, 8, 4, 2])
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, decoder.config.latent, 40, generator=g)
    bumped = z.clone()
    bumped[..., 20] += 1.0
    with torch.inference_mode():
        diff = (decoder.decoder(z, None, False) - decoder.decoder(bumped, None, False))[0, 0].abs()
    changed = torch.nonzero(diff > 0).flatten()
    step_start, step_end = 20 * 512, 21 * 512
    assert step_start - reach <= changed.min() and changed.max() < step_end + reach
    assert changed.min() < step_start - SPF and changed.max() > step_end + SPF  # it reaches > 1 frame


def test_pcm16_scales_like_the_official_decoder():
    pcm = to_pcm16(torch.tensor([0.0, 1.0, -1.0, 0.5, -0.5]))
    assert pcm == torch.tensor([0, 32767, -32767, 16383, -16383], dtype=torch.int16).numpy().tobytes()
