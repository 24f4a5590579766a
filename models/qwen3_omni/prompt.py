"""The chat prompt as token ids, and what the Talker reads of it.

``<|im_start|>system\\n{system}<|im_end|>\\n`` (when given), then the user turn with each audio as
``<|audio_start|><|audio_pad|>*n<|audio_end|>`` and each image as
``<|vision_start|><|image_pad|>*n<|vision_end|>`` (videos alike, with ``<|video_pad|>``) before the text, then
``<|im_start|>assistant\\n``. Role names and the newline come from the tokenizer; every other
special id from ``config.json``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mstar.models.qwen3_omni.config import TokenIds


@dataclass(frozen=True)
class MediaTokens:
    audio_end: int
    vision_end: int


def build_prompt(encode: Callable[[str], list[int]], ids: TokenIds, media_ids: MediaTokens, text: str,
                 system: str | None = None, audio_rows: Sequence[int] = (), image_rows: Sequence[int] = (),
                 video_rows: Sequence[int] = ()) -> list[int]:
    """Images come before videos: the vision encoder's rows (and DeepStack's) are in that order."""
    nl = encode("\n")
    out: list[int] = []
    if system:
        out += [ids.im_start, ids.system, *nl, *encode(system), ids.im_end, *nl]
    out += [ids.im_start, ids.user, *nl]
    for n in audio_rows:
        out += [ids.audio_start, *([ids.audio] * n), media_ids.audio_end]
    for n in image_rows:
        out += [ids.vision_start, *([ids.image] * n), media_ids.vision_end]
    for n in video_rows:
        out += [ids.vision_start, *([ids.video] * n), media_ids.vision_end]
    out += [*encode(text), ids.im_end, *nl, ids.im_start, ids.assistant, *nl]
    return out


@dataclass(frozen=True)
class TalkerPrompt:
    rows: torch.Tensor  # indices into the prompt: the user turns' tokens, then the last "<|im_start|>assistant\n"
    mm: torch.Tensor  # bool per row: a media placeholder (the Talker reads its hidden state)
    ids: list[int]  # the Talker's prompt ids (user rows' ids, then tts_pad for the assistant's 9 rows)


def talker_prompt(prompt: Sequence[int], ids: TokenIds) -> TalkerPrompt:
    """Which prompt rows the Talker's prompt is built from, as transformers' ``generate`` picks
    them: every token of a user turn (``<|im_start|>user`` ... up to the next ``<|im_start|>``),
    then the 3 tokens of the last ``<|im_start|>assistant\\n``."""
    n = len(prompt)
    role, user_rows = None, []
    for i, tok in enumerate(prompt):
        if tok == ids.im_start:
            role = prompt[i + 1] if i + 1 < n else None
        if role == ids.user:
            user_rows.append(i)
    starts = [i for i in range(n - 1) if prompt[i] == ids.im_start and prompt[i + 1] == ids.assistant]
    if not starts or starts[-1] + 3 > n:
        raise ValueError("the prompt does not end with '<|im_start|>assistant\\n'")
    rows = user_rows + [starts[-1], starts[-1] + 1, starts[-1] + 2]
    media = {ids.audio, ids.image, ids.video}
    mm = torch.tensor([prompt[r] in media for r in rows], dtype=torch.bool)
    talker_ids = [prompt[r] for r in user_rows] + [ids.tts_pad] * 9
    return TalkerPrompt(torch.tensor(rows, dtype=torch.int64), mm, talker_ids)
