"""Orpheus prompt format, special token ids and the custom-token <-> SNAC code mapping.

Source of truth: canopyai/Orpheus-TTS (commit 835ac7c), `orpheus_tts_pypi/orpheus_tts/engine_class.py`
(`_format_prompt`), `orpheus_tts/decoder.py` (`turn_token_into_id`, `convert_to_audio`,
`tokens_decoder`), `pretrain/train.py` (custom tokens added to the Llama-3 tokenizer),
`finetune/config.yaml` (pad token) and the README (voices, prompt "{name}: {text}").

The Llama-3 tokenizer has 128256 ids; pretraining appended `<custom_token_0>` ..
`<custom_token_28682>` (7 * 4096 + 10 + 1 tokens), so `<custom_token_N>` is id 128256 + N and the
checkpoint's vocab_size is 156940. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

LLAMA3_VOCAB_SIZE = 128256  # `<custom_token_N>` has id LLAMA3_VOCAB_SIZE + N
ORPHEUS_VOCAB_SIZE = 156940  # embedding rows of orpheus-3b-0.1-ft (ids 0..156938 are named tokens)

BEGIN_OF_TEXT = 128000  # <|begin_of_text|>: the BOS the Llama-3 tokenizer prepends to the text
END_OF_TEXT = 128009  # <|eot_id|>; closes the human text
START_OF_SPEECH = 128257  # <custom_token_1>; last prompt token, audio follows
END_OF_SPEECH = 128258  # <custom_token_2>; the stop token for generation
START_OF_HUMAN = 128259  # <custom_token_3>
END_OF_HUMAN = 128260  # <custom_token_4>
START_OF_AI = 128261  # <custom_token_5>
END_OF_AI = 128262  # <custom_token_6>
PAD = 128263  # <custom_token_7> (finetune/config.yaml pad_token)

# Why the decode loop ended, as the LLM node reports it to the conductor at the loop's end (M*'s
# own values, not token ids): not yet, end-of-speech sampled, max_tokens reached.
FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2

AUDIO_TOKEN_OFFSET = 128266  # <custom_token_10>: code 0 at frame position 0
CODES_PER_POSITION = 4096  # SNAC codebook size; each frame position has its own id block
TOKENS_PER_FRAME = 7  # 1 + 2 + 4 codes of SNAC levels 0/1/2
# the sliding window the SNAC decoder reads: 4 frames, advancing 1 (the official decoder's); a frame
# is decoded once it has RIGHT_CONTEXT_FRAMES after it, so the first window (frame 0 + its right
# context) is 3 frames
RIGHT_CONTEXT_FRAMES = 2
OFFICIAL_WINDOW_FRAMES = 4
FIRST_WINDOW_FRAMES = 1 + RIGHT_CONTEXT_FRAMES
FIRST_WINDOW_CODES = FIRST_WINDOW_FRAMES * TOKENS_PER_FRAME
MAX_STRIDE_FRAMES = 8


@dataclass(frozen=True)
class WindowPlan:
    """How the code stream is cut for the SNAC decoder, in codes."""

    first: int  # the first window: once this many codes exist
    window: int  # later windows: this many codes ...
    stride: int  # ... every this many new codes


def window_plan(model_kwargs: dict) -> WindowPlan:
    """The server knobs ``first_window_frames`` (3: frame 0 as soon as it has its two frames of right
    context, the default; 4: as the official decoder) and ``snac_stride_frames`` (1, the default and
    the official decoder's: a window per frame; n: a window per n frames, n + 3 frames long, so each
    emitted frame keeps at least one frame of left and two of right context, and the decoder runs
    (n + 3) / n frames per emitted frame instead of 4), validated."""
    first = model_kwargs.get("first_window_frames", FIRST_WINDOW_FRAMES)
    if type(first) is not int or first not in (FIRST_WINDOW_FRAMES, OFFICIAL_WINDOW_FRAMES):
        raise ValueError(f"model_kwargs.first_window_frames must be 3 or 4, got {first!r}")
    stride = model_kwargs.get("snac_stride_frames", 1)
    if type(stride) is not int or not 1 <= stride <= MAX_STRIDE_FRAMES:
        raise ValueError(f"model_kwargs.snac_stride_frames must be an integer in [1, {MAX_STRIDE_FRAMES}], got {stride!r}")
    window = stride + 1 + RIGHT_CONTEXT_FRAMES
    return WindowPlan(first * TOKENS_PER_FRAME, window * TOKENS_PER_FRAME, stride * TOKENS_PER_FRAME)
AUDIO_TOKEN_END = AUDIO_TOKEN_OFFSET + TOKENS_PER_FRAME * CODES_PER_POSITION  # exclusive: 156938

# Order of "conversational realism" per the README; English finetune-prod voices.
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")

# Frame position -> (SNAC level, index within that level's share of the frame).
# convert_to_audio: level 0 <- [0], level 1 <- [1, 4], level 2 <- [2, 3, 5, 6].
FRAME_LAYOUT = ((0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (2, 2), (2, 3))
LEVEL_CODES_PER_FRAME = (1, 2, 4)


class InvalidAudioToken(ValueError):
    """A generated id is not an audio token for the frame position it lands on."""


@dataclass(frozen=True)
class SnacCodes:
    """Codes of the three SNAC levels for `num_frames` frames (lengths F, 2F, 4F)."""

    level0: tuple[int, ...]
    level1: tuple[int, ...]
    level2: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.level0)
        if (len(self.level1), len(self.level2)) != (2 * n, 4 * n):
            raise ValueError(
                f"SNAC level lengths must be (F, 2F, 4F); got "
                f"({len(self.level0)}, {len(self.level1)}, {len(self.level2)})"
            )

    @property
    def num_frames(self) -> int:
        return len(self.level0)

    @property
    def levels(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (self.level0, self.level1, self.level2)


# ---------------------------------------------------------------------------- prompt


def prompt_text(text: str, voice: str | None, *, voices: Sequence[str] = VOICES) -> str:
    """The text the tokenizer sees: "{voice}: {text}", or the bare text without a voice.

    `voices` defaults to the English finetune-prod voices; multilingual checkpoints have others.
    """
    if voice is None:
        return text
    if voice not in voices:
        raise ValueError(f"Unknown Orpheus voice {voice!r}. Known: {', '.join(voices)} (or None)")
    return f"{voice}: {text}"


def wrap_prompt_ids(text_ids: Sequence[int]) -> list[int]:
    """[START_OF_HUMAN] + text ids + [END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH].

    `text_ids` is the tokenizer's output for `prompt_text(...)` including its BOS (128000), as
    in the official `_format_prompt`. (The official vLLM path then decodes these ids to a string and
    vLLM re-tokenizes it, prepending one more BOS; we keep the id-level form the HF notebook uses.)
    """
    return [START_OF_HUMAN, *text_ids, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]


def build_prompt_ids(
    encode: Callable[[str], Sequence[int]], text: str, voice: str | None, *, voices: Sequence[str] = VOICES
) -> list[int]:
    """Prompt ids for one request; `encode` is the tokenizer (adds BOS as Llama-3 does)."""
    return wrap_prompt_ids(list(encode(prompt_text(text, voice, voices=voices))))


# ---------------------------------------------------------------------------- token <-> code


def is_audio_token(token_id: int) -> bool:
    return AUDIO_TOKEN_OFFSET <= token_id < AUDIO_TOKEN_END


def audio_token_id(code: int, position: int) -> int:
    """The custom token id that carries `code` at frame `position` (0..6)."""
    if not 0 <= position < TOKENS_PER_FRAME:
        raise ValueError(f"frame position must be in [0, {TOKENS_PER_FRAME}), got {position}")
    if not 0 <= code < CODES_PER_POSITION:
        raise ValueError(f"SNAC code must be in [0, {CODES_PER_POSITION}), got {code}")
    return AUDIO_TOKEN_OFFSET + position * CODES_PER_POSITION + code


def code_of_token(token_id: int, position: int) -> int:
    """SNAC code carried by `token_id` at frame `position`; raises InvalidAudioToken if none."""
    code = token_id - AUDIO_TOKEN_OFFSET - position * CODES_PER_POSITION
    if not 0 <= code < CODES_PER_POSITION:
        lo = AUDIO_TOKEN_OFFSET + position * CODES_PER_POSITION
        raise InvalidAudioToken(
            f"token {token_id} is not an audio token for frame position {position}: "
            f"expected an id in [{lo}, {lo + CODES_PER_POSITION})"
        )
    return code


def codes_from_tokens(token_ids: Sequence[int], *, skip_invalid: bool = False) -> list[int]:
    """Generated token ids -> SNAC codes in frame order (position = accepted count % 7).

    skip_invalid=False (default) raises InvalidAudioToken naming the index of the first bad token.
    skip_invalid=True drops a bad token without advancing the frame position, like the official
    `tokens_decoder`, with two deliberate differences: the official check `token > 0` also drops
    the valid code 0, and it lets codes > 4096 through and then silently drops every 4-frame
    window containing them; we keep code 0 and drop any code outside [0, 4096) at the token.
    """
    codes: list[int] = []
    for index, token_id in enumerate(token_ids):
        try:
            codes.append(code_of_token(token_id, len(codes) % TOKENS_PER_FRAME))
        except InvalidAudioToken as exc:
            if not skip_invalid:
                raise InvalidAudioToken(f"generated token #{index}: {exc}") from None
    return codes


def tokens_from_codes(codes: Sequence[int]) -> list[int]:
    """Inverse of `codes_from_tokens` (strict mode)."""
    return [audio_token_id(code, i % TOKENS_PER_FRAME) for i, code in enumerate(codes)]


# ---------------------------------------------------------------------------- code <-> SNAC levels


def snac_codes(codes: Sequence[int]) -> SnacCodes:
    """7 codes per frame -> the three SNAC levels, as the official `convert_to_audio` splits them.

    Raises on a partial trailing frame (the official decoder silently truncates it): callers
    that stream decide themselves when a frame is complete.
    """
    if len(codes) % TOKENS_PER_FRAME:
        raise ValueError(
            f"{len(codes)} codes is not a whole number of {TOKENS_PER_FRAME}-code frames "
            f"({len(codes) % TOKENS_PER_FRAME} left over)"
        )
    levels: tuple[list[int], list[int], list[int]] = ([], [], [])
    for i, code in enumerate(codes):
        if not 0 <= code < CODES_PER_POSITION:
            raise ValueError(f"code #{i} = {code} is outside [0, {CODES_PER_POSITION})")
        levels[FRAME_LAYOUT[i % TOKENS_PER_FRAME][0]].append(code)
    return SnacCodes(tuple(levels[0]), tuple(levels[1]), tuple(levels[2]))


def frame_codes(snac: SnacCodes) -> list[int]:
    """Inverse of `snac_codes`: interleave the levels back into 7 codes per frame."""
    out: list[int] = []
    for frame in range(snac.num_frames):
        for level, k in FRAME_LAYOUT:
            out.append(snac.levels[level][frame * LEVEL_CODES_PER_FRAME[level] + k])
    return out
