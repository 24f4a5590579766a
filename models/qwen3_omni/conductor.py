"""A request as the walks need it, made on the conductor: the chat prompt's ids with media
placeholders, M-RoPE positions for the Thinker and the Talker, and each walk's inputs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mstar.models.base import InvalidArgument, Prompt, RequestState
from mstar.models.qwen3_omni.positions import mrope_positions
from mstar.models.qwen3_omni.prompt import build_prompt, talker_prompt
from mstar.models.tokens import encode_ids

if TYPE_CHECKING:
    from mstar.models.qwen3_omni.model import Qwen3OmniModel


def build_request(model: Qwen3OmniModel, prompt: Prompt) -> RequestState:
    cfg, ids, kw = model.omni, model.omni.ids, prompt.kwargs
    if not prompt.text.strip() and not prompt.files:
        raise InvalidArgument("text", "must not be empty")
    speech = "audio" in kw["modalities"]
    if "text" not in kw["modalities"]:
        raise InvalidArgument("model_kwargs.modalities", 'must include "text" (the Talker speaks the Thinker\'s text)')
    speaker = cfg.speakers.get(kw["voice"].lower())
    if speech and speaker is None:
        raise InvalidArgument("model_kwargs.voice", f"unknown voice {kw['voice']!r}; known: {', '.join(sorted(cfg.speakers))}")
    media = model.media.decode(prompt.files)
    encode = lambda s: encode_ids(model.tokenizer, s, add_special_tokens=False)  # noqa: E731
    ids_list = build_prompt(encode, ids, model.media_tokens, prompt.text, kw["system"], media.audio_rows, media.image_rows,
                            media.video_rows)
    limit = model.max_seq_len - kw["max_tokens"]  # the placement YAML's max_seq_len
    if len(ids_list) > limit:
        raise InvalidArgument("text", f"prompt is {len(ids_list)} tokens; with max_tokens={kw['max_tokens']} at most "
                                      f"{limit} fit in max_seq_len={model.max_seq_len}")
    rope = dict(audio_id=ids.audio, image_id=ids.image, video_id=ids.video, audio_rows=media.audio_rows,
                image_grids=media.grids, video_grids=media.video_grids, video_seconds=media.video_seconds,
                merge=cfg.vision.spatial_merge_size)
    positions, delta = mrope_positions(ids_list, per_second=cfg.position_id_per_seconds, **rope)  # type: ignore[arg-type]
    state = RequestState(prompt, prompt_tokens=len(ids_list), finish_reason="length")
    h, dv = cfg.text.hidden_size, cfg.vision.out_hidden_size
    prefill = {"prompt_ids": torch.tensor(ids_list), "positions": positions, "delta": torch.tensor([delta]),
               "talker_rows": torch.zeros(0, dtype=torch.int64), "talker_mm": torch.zeros(0, dtype=torch.bool)}
    speak = None
    if speech:
        tp = talker_prompt(ids_list, ids)
        if len(tp.ids) + kw["max_audio_frames"] > model.max_seq_len:
            raise InvalidArgument("model_kwargs.max_audio_frames", f"the Talker's prompt ({len(tp.ids)}) + "
                                  f"{kw['max_audio_frames']} frames exceed max_seq_len={model.max_seq_len}")
        tpos, tdelta = mrope_positions(tp.ids, per_second=cfg.talker_position_id_per_seconds, **rope)  # type: ignore[arg-type]
        prefill |= {"talker_rows": tp.rows, "talker_mm": tp.mm}
        speak = {"talker_mm": tp.mm, "talker_positions": tpos, "talker_delta": torch.tensor([tdelta]),
                 "speaker": torch.tensor([speaker])}
    encode_inputs = None
    if media.empty:
        k = len(cfg.vision.deepstack_visual_indexes)
        prefill |= {"audio_embeds": torch.zeros(0, h), "image_embeds": torch.zeros(0, dv), "deepstack": torch.zeros(k, 0, dv)}
    else:
        encode_inputs = {"audio_features": media.audio_features, "audio_lengths": torch.tensor(media.audio_lengths, dtype=torch.int64),
                         "pixels": media.pixels,  # images', then videos' patches: one encoder pass
                         "image_grids": torch.tensor(media.grids + media.video_grids, dtype=torch.int64).reshape(-1, 3)}
    state.data.update(encode=encode_inputs, prefill=prefill, speak=speak, ids=[], text="", ended=False,
                      stop_ids=set() if kw["ignore_eos"] else {ids.im_end})
    return state
