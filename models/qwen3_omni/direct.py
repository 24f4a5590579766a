"""Qwen3-Omni without the runtime: load the parts and run one request start to end on the same
engines the nodes drive (tests compare the served stream with this, and this with transformers;
the benchmark's single-stream floor).

The Thinker's text stream to the Talker, as the nodes make it: decode iteration i (reading token
t_i) streams the embedding of t_i, and its last iteration also the embedding of ``<|tts_eos|>``;
Talker step k reads row k (row 0 with its prompt), then ``<|tts_pad|>`` once the rows ran out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from mstar.models.graph import LeftContext
from mstar.models.qwen3_omni.audio import AudioEncoder
from mstar.models.qwen3_omni.code2wav import Code2Wav
from mstar.models.qwen3_omni.config import OmniConfig
from mstar.models.qwen3_omni.positions import mrope_positions
from mstar.models.qwen3_omni.prompt import talker_prompt
from mstar.models.qwen3_omni.sampling import GREEDY, Sampling
from mstar.models.qwen3_omni.talker import Talker
from mstar.models.qwen3_omni.talker_engine import TalkerEngine, TalkerFeed, TalkerStart
from mstar.models.qwen3_omni.thinker import Thinker
from mstar.models.qwen3_omni.thinker_engine import ThinkerEngine, ThinkerStart
from mstar.models.qwen3_omni.vision import VisionEncoder
from mstar.models.qwen3_omni.weights import CheckpointReader, load_module


@dataclass
class Parts:
    cfg: OmniConfig
    reader: CheckpointReader
    device: str
    dtype: torch.dtype
    thinker: Thinker | None = None
    talker: Talker | None = None
    code2wav: Code2Wav | None = None
    audio: AudioEncoder | None = None
    vision: VisionEncoder | None = None

    def specials(self) -> torch.Tensor:
        """The Thinker's embeddings of tts_bos, tts_eos, tts_pad (rows read from the checkpoint)."""
        i = self.cfg.ids
        shape = (self.cfg.text.vocab_size, self.cfg.text.hidden_size)
        return self.reader.rows("thinker.model.embed_tokens.weight", [i.tts_bos, i.tts_eos, i.tts_pad], shape)


def load_parts(directory: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
               parts: tuple[str, ...] = ("thinker", "talker", "code2wav", "audio", "vision"), tp=None) -> Parts:
    """``tp``: a ``TensorParallel`` rank: the Thinker is this rank's shard (``thinker_tp.py``)."""
    reader = CheckpointReader(directory)
    cfg = OmniConfig.parse(reader.config())
    p = Parts(cfg, reader, device, dtype)
    build = {"thinker": (lambda: Thinker(cfg.text), "thinker."), "talker": (lambda: Talker(cfg), "talker."),
             "code2wav": (lambda: Code2Wav(cfg.code2wav), "code2wav."),
             "audio": (lambda: AudioEncoder(cfg.audio), "thinker.audio_tower."),
             "vision": (lambda: VisionEncoder(cfg.vision), "thinker.visual.")}
    for name in parts:
        make, prefix = build[name]
        shard = None
        if tp is not None and tp.size > 1 and name == "thinker":
            from mstar.models.qwen3_omni.thinker_tp import ThinkerShard, sharded_thinker

            shard = ThinkerShard(cfg.text, tp.rank, tp.size)
            make = lambda s=shard: sharded_thinker(s, tp)  # noqa: E731
        elif tp is not None and tp.size > 1:
            raise ValueError(f"qwen3_omni part '{name}' does not run tensor-parallel (only the Thinker does)")
        with torch.device("meta"):  # parameters without memory; buffers are made on the CPU
            module = make()
        load_module(module, reader, prefix, dtype=dtype, device=device, shard=shard)
        setattr(p, name, module.eval())
    return p


@dataclass
class Result:
    tokens: list[int]
    codes: torch.Tensor  # [frames, num_code_groups]
    audio: torch.Tensor  # [samples]
    talker_prompt_len: int = 0
    extra: dict = field(default_factory=dict)


@torch.inference_mode()
def generate(p: Parts, prompt: list[int], *, speaker: str = "ethan", max_tokens: int = 64,
             talker_max_tokens: int = 256, thinker_sampling: Sampling = GREEDY,
             talker_sampling: Sampling = GREEDY, repetition_penalty: float = 1.05,
             speech: bool = True, chunk: int = 300, left_context: int = 25, seed: int | None = None,
             audio_embeds: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None,
             deepstack: list[torch.Tensor] | None = None, image_grids: list[list[int]] | None = None,
             audio_rows: list[int] | None = None, video_embeds: torch.Tensor | None = None,
             video_grids: list[list[int]] | None = None, video_seconds: list[float] | None = None,
             policy=None) -> Result:
    """``deepstack``: per DeepStack layer, the rows of every image then every video (prompt order)."""
    cfg, ids = p.cfg, p.cfg.ids
    assert p.thinker is not None
    rope = dict(audio_id=ids.audio, image_id=ids.image, video_id=ids.video, audio_rows=audio_rows or (),
                image_grids=image_grids or (), video_grids=video_grids or (), video_seconds=video_seconds or (),
                merge=cfg.vision.spatial_merge_size)
    pos, delta = mrope_positions(prompt, per_second=cfg.position_id_per_seconds, **rope)  # type: ignore[arg-type]
    tp = talker_prompt(prompt, ids) if speech else None
    media = {}
    if audio_embeds is not None:
        media[ids.audio] = audio_embeds
    if image_embeds is not None:
        media[ids.image] = image_embeds
    if video_embeds is not None:
        media[ids.video] = video_embeds
    ids_t = torch.tensor(prompt)
    thinker = ThinkerEngine(p.thinker, cfg.accept_hidden_layer, 1, len(prompt) + max_tokens + 1)
    thinker.submit("r", ThinkerStart(ids_t, pos, delta, thinker_sampling, max_tokens, (ids.im_end,), media,
                                     deepstack or [], (ids.image, ids.video), tp.rows if tp else None,
                                     tp.mm if tp else None, seed))
    tokens, rows, first = [], [], None
    while thinker.has_work:
        for out in thinker.step():
            tokens.append(out.token_id)
            if first is None:
                first = out.extra
            elif speech:
                rows.append(out.extra["input_embed"])
            if out.finished and speech and len(tokens) > 1:
                rows.append(p.thinker.embed(torch.tensor([ids.tts_eos], device=p.device))[0])
    if not speech or len(tokens) < 2:
        return Result(tokens, torch.empty(0, cfg.num_code_groups, dtype=torch.int64), torch.empty(0))
    assert p.talker is not None and p.code2wav is not None and first is not None
    tids = tp.ids  # type: ignore[union-attr]
    tpos, tdelta = mrope_positions(tids, per_second=cfg.talker_position_id_per_seconds, **rope)  # type: ignore[arg-type]
    talker = TalkerEngine(p.talker, p.specials(), 1, len(tids) + talker_max_tokens + 1)
    speaker_id = cfg.speakers[speaker.lower()]
    talker.submit("r", TalkerStart(first["talker_prompt"], tp.mm, rows[0], speaker_id, tpos, tdelta,  # type: ignore[union-attr]
                                   talker_sampling, talker_max_tokens, repetition_penalty, seed))
    frames, k = [], 0
    while True:
        (out,) = talker.step()
        if out.extra["frame"] is not None:
            frames.append(out.extra["frame"])
        if out.finished:
            break
        k += 1
        talker.submit("r", TalkerFeed(rows[k] if k < len(rows) else None))
    codes = torch.stack(frames) if frames else torch.empty(0, cfg.num_code_groups, dtype=torch.int64)
    audio = torch.empty(0)
    if frames:
        audio = stream_decode(p.code2wav, codes, policy or LeftContext(chunk, left_context))
    return Result(tokens, codes, audio, len(tids))


def stream_decode(code2wav: Code2Wav, codes: torch.Tensor, policy) -> torch.Tensor:
    """codes [frames, groups] -> samples, chunked as the served stream cuts them (the runtime's own
    chunker under ``policy``), each chunk's new frames decoded after its context."""
    from mstar.models.chunker import Chunker

    chunker, out = Chunker(policy), []
    chunks = [c for row in codes for c in chunker.push(row[None])] + chunker.finish()
    for info, rows in chunks:
        context = info.new_from - info.start
        if rows.shape[0] > context:
            out.append(code2wav.decode_chunk(rows.T[None].to(next(code2wav.parameters()).device), context)[0, 0])
    return torch.cat(out).float().cpu() if out else torch.empty(0)
