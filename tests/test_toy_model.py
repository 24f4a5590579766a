"""The toy model's compute (table lookups, numpy PCM) against the direct formulas it replaced."""

import math

import torch

from mstar.models.base import Emit, Prompt
from mstar.models.toy.model import SAMPLE_RATE, SAMPLES_PER_TOKEN, ToyModel, rot13, tone


def test_rot13_and_tone_equal_their_formulas_for_every_byte():
    b = torch.arange(256)
    want = torch.tensor([ord(c) for c in "".join(map(chr, range(256))).translate(
        str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
                      "NOPQRSTUVWXYZABCDEFGHIJKLMnopqrstuvwxyzabcdefghijklm"))])
    assert torch.equal(rot13(b), want) and torch.equal(rot13(rot13(b)), b)
    t = torch.arange(SAMPLES_PER_TOKEN, dtype=torch.float32) / SAMPLE_RATE
    freqs = 200.0 + 4.0 * b.to(torch.float32)
    assert torch.equal(tone(b), (0.3 * torch.sin(2 * math.pi * freqs[:, None] * t[None, :])).reshape(-1))


def test_audio_pcm_rounds_as_torch_does():
    model = ToyModel()
    state = model.process_prompt(Prompt(text="hi", files=[], kwargs=model.validate_kwargs({})))
    x = torch.cat([torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 0.7,
                   torch.tensor([0.5, 1.5, -0.5, 2.5, -2.5]) / 32767, torch.tensor([1.0, -1.0, 1.3, -7.0])])
    (out,) = model.postprocess(state, Emit("audio", "speak", "synth", 0, 0, x))
    assert out.data == (x.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
