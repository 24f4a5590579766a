"""`mstar serve MODEL --random-weights` says what the random checkpoint's output is for that model,
from the kinds of output it emits (speech only where it speaks)."""

import pytest

from mstar.cli import random_weights_line
from mstar.models.registry import create_model


@pytest.mark.parametrize("model, says", [
    ("orpheus", "(audio: noise, not speech)"),
    ("qwen3_omni", "(text: random tokens; audio: noise, not speech)"),
    ("bagel", "(text: random tokens; images: noise, not pictures)"),
    ("pi05", "(actions: random, not a trained model's)"),
    ("vjepa2", "(actions: random, not a trained model's; embeddings: random, not a trained encoder's)"),
])
def test_each_model_is_told_what_its_random_output_is(model, says, tmp_path):
    line = random_weights_line(create_model(model, {}, str(tmp_path)), str(tmp_path), [f"{tmp_path}/ckpt"])
    assert line == (f"mstar: WARNING: --random-weights: serving a tiny RANDOM '{model}' checkpoint from {tmp_path} "
                    f"(written now: {tmp_path}/ckpt); its output means nothing {says}")


def test_a_model_without_weights_writes_none():
    line = random_weights_line(create_model("toy", {}, None), "/unused", [])
    assert line == "mstar: note: --random-weights: 'toy' has no weights; it serves as always"
