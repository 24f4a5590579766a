"""Qwen3-Omni's graph nodes: the Thinker and the Talker as engine nodes (prepare / outputs /
check_stop over their engines), the two encoders and Code2Wav as stateless batches."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mstar.models.base import EngineNode, NodeCall, NodeContext, NodeSubmodule
from mstar.models.chunker import Chunker
from mstar.models.qwen3_omni.cache import NoCache
from mstar.models.qwen3_omni.code2wav import ChunkGraphs
from mstar.models.qwen3_omni.direct import load_parts
from mstar.models.qwen3_omni.knobs import OmniServeConfig
from mstar.models.qwen3_omni.layers import compile_layers, warm_compiled
from mstar.models.qwen3_omni.model import codec_policy
from mstar.models.qwen3_omni.predictor_loop import warm_predictor
from mstar.models.qwen3_omni.sampling import Sampling
from mstar.models.qwen3_omni.talker_engine import TalkerEngine, TalkerFeed, TalkerStart
from mstar.models.qwen3_omni.thinker_engine import OmniOut, ThinkerEngine, ThinkerStart

log = logging.getLogger(__name__)
DONE, GOING = torch.tensor([1]), torch.tensor([0])


def dtype_of(ctx: NodeContext) -> torch.dtype:
    d = OmniServeConfig.parse(ctx.model_kwargs).dtype
    if d == "auto":
        return torch.bfloat16 if ctx.device.startswith("cuda") else torch.float32
    return getattr(torch, d)


class ThinkerNode(EngineNode):
    """prefill: start the sequence (prompt, media rows, positions), answer with its first token
    and the rows the Talker's prompt is built from; think / speak: one token an iteration. In
    speak, iteration i (which read token t_i) also streams the embedding of t_i to the Talker,
    and its last iteration the embedding of <|tts_eos|> after it."""

    def __init__(self, checkpoint: Path, ctx: NodeContext, max_seq_len: int):
        kw = OmniServeConfig.parse(ctx.model_kwargs)
        tp = None
        if ctx.tp is not None:  # tp_size > 1: every rank builds this node; ranks past 0 then follow
            from mstar.services.engines.tensor_parallel import TensorParallel

            tp = self.tensor_parallel = TensorParallel(ctx.tp, ctx.device)
        p = load_parts(checkpoint, ctx.device, dtype_of(ctx), ("thinker",), tp=tp)
        self.cfg, self.thinker = p.cfg, p.thinker
        assert self.thinker is not None
        if ctx.compile:  # the layers' small kernels fused around their GEMMs and attention, compiled now
            compile_layers(self.thinker.model)
            warm_compiled(lambda e, pos: self.thinker(e, pos, NoCache()), p.cfg.text.hidden_size, dtype_of(ctx), ctx.device)
        self.engine = ThinkerEngine(self.thinker, p.cfg.accept_hidden_layer, kw.max_num_seqs, max_seq_len,
                                    kw.max_prefill_tokens, tp=tp, cuda_graphs=kw.cuda_graphs)
        with torch.inference_mode():
            self.tts_eos = self.thinker.embed(torch.tensor([p.cfg.ids.tts_eos], device=ctx.device)).float().cpu()
        self.stop = (p.cfg.ids.im_end,)
        self.no_rows = torch.zeros(0, p.cfg.text.hidden_size)
        log.info("qwen3-omni thinker loaded from %s on %s%s", checkpoint, ctx.device,
                 f" (tensor-parallel rank {tp.rank} of {tp.size})" if tp is not None else "")

    def prepare(self, call: NodeCall) -> ThinkerStart | None:
        if call.walk != "prefill":
            return None
        i, kw = call.inputs, call.kwargs
        media, ids = {}, self.cfg.ids
        if i["audio_embeds"].numel():
            media[ids.audio] = i["audio_embeds"]
        if i["image_embeds"].numel():  # the vision encoder's rows: images' first, then videos'
            n = int((i["prompt_ids"] == ids.image).sum())
            visual = i["image_embeds"]
            media |= {ids.image: visual[:n]} if n else {}
            media |= {ids.video: visual[n:]} if n < visual.shape[0] else {}
        deep = list(i["deepstack"].unbind(0)) if i["image_embeds"].numel() else []
        rows = i["talker_rows"]
        return ThinkerStart(i["prompt_ids"], i["positions"], int(i["delta"]), Sampling(kw["temperature"], kw["top_k"], kw["top_p"]),
                            kw["max_tokens"], () if kw["ignore_eos"] else self.stop, media, deep, (self.cfg.ids.image, self.cfg.ids.video),
                            rows if rows.numel() else None, i["talker_mm"] if rows.numel() else None, kw["seed"])

    def outputs(self, call: NodeCall, out: OmniOut | None) -> dict[str, torch.Tensor]:
        if out is None:  # the sequence ended before this iteration (at its first token)
            return {"token": torch.tensor([self.stop[0]]), "text": torch.zeros(0, dtype=torch.int64), "done": DONE,
                    "text_rows": self.no_rows}
        token = torch.tensor([out.token_id])
        extra = out.extra or {}
        if call.walk == "prefill":
            prompt = extra.get("talker_prompt")
            return {"token": token, "text": token,
                    "talker_prompt": prompt.float().cpu() if prompt is not None else self.no_rows}
        res = {"token": token, "text": token, "done": DONE if out.finished else GOING}
        if call.walk == "speak":
            row = extra["input_embed"].float().cpu()[None]
            res["text_rows"] = torch.cat([row, self.tts_eos]) if out.finished else row
        return res

    def check_stop(self, call: NodeCall, outputs: dict[str, torch.Tensor]) -> bool:
        return bool(outputs["done"].item())


class TalkerNode(EngineNode):
    """Iteration 0 starts the Talker on its prompt (the Thinker's rows, the voice, the first
    text row); each later one feeds the next text row (or none: the text ended) and answers with
    one codec frame (none at the end of speech)."""

    def __init__(self, checkpoint: Path, ctx: NodeContext, max_seq_len: int):
        kw = OmniServeConfig.parse(ctx.model_kwargs)
        p = load_parts(checkpoint, ctx.device, dtype_of(ctx), ("talker",))
        assert p.talker is not None
        self.cfg = p.cfg
        p.talker.code_predictor.cuda_graphs = kw.cuda_graphs
        if ctx.compile:  # the Talker's layers and the code predictor's frame loop
            cp = p.talker.code_predictor
            compile_layers(p.talker.model)
            compile_layers(cp.model)
            warm_compiled(lambda e, pos: p.talker(e, pos, NoCache()), p.cfg.talker.hidden_size, dtype_of(ctx), ctx.device)
            warm_predictor(cp, dtype_of(ctx), ctx.device, kw.max_num_seqs)
        self.engine = TalkerEngine(p.talker, p.specials(), kw.max_num_seqs, max_seq_len, kw.cuda_graphs)
        self.gather_s = kw.talker_gather_ms / 1e3
        self.no_frame = torch.zeros(0, p.cfg.num_code_groups, dtype=torch.int64)
        log.info("qwen3-omni talker loaded from %s on %s", checkpoint, ctx.device)

    def prepare(self, call: NodeCall) -> TalkerStart | TalkerFeed | None:
        i, kw = call.inputs, call.kwargs
        rows = i.get("text_rows")
        row = rows[0] if rows is not None and rows.shape[0] else None
        if call.iteration == 0:
            if row is None:  # the Thinker said nothing: no speech
                return None
            return TalkerStart(i["talker_prompt"], i["talker_mm"], row, int(i["speaker"]), i["talker_positions"],
                               int(i["talker_delta"]), Sampling(kw["talker_temperature"], kw["talker_top_k"], kw["talker_top_p"]),
                               kw["max_audio_frames"], kw["talker_repetition_penalty"], kw["seed"], kw["ignore_eos"])
        return TalkerFeed(row)

    def outputs(self, call: NodeCall, out: OmniOut | None) -> dict[str, torch.Tensor]:
        if out is None:
            return {"codes": self.no_frame, "done": DONE}
        frame = (out.extra or {}).get("frame")
        return {"codes": self.no_frame if frame is None else frame[None], "done": DONE if out.finished else GOING}

    def check_stop(self, call: NodeCall, outputs: dict[str, torch.Tensor]) -> bool:
        return bool(outputs["done"].item())


class _Stateless(NodeSubmodule):
    blocking = True

    def forward(self, batch: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        with torch.inference_mode():
            return [self.one(c) for c in batch]

    def one(self, call: NodeCall) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class AudioEncoderNode(_Stateless):
    def __init__(self, checkpoint: Path, ctx: NodeContext):
        p = load_parts(checkpoint, ctx.device, dtype_of(ctx), ("audio",))
        self.enc, self.device, self.dim = p.audio, ctx.device, p.cfg.audio.output_dim

    def one(self, call):
        lengths = call.inputs["audio_lengths"]
        if lengths.numel() == 0:
            return {"audio_embeds": torch.zeros(0, self.dim)}
        p = next(self.enc.parameters())
        out = self.enc(call.inputs["audio_features"].to(self.device, p.dtype), lengths)
        return {"audio_embeds": out.float().cpu()}


class VisionEncoderNode(_Stateless):
    def __init__(self, checkpoint: Path, ctx: NodeContext):
        p = load_parts(checkpoint, ctx.device, dtype_of(ctx), ("vision",))
        self.enc, self.device, self.cfg = p.vision, ctx.device, p.cfg.vision

    def one(self, call):
        grids = call.inputs["image_grids"]
        if grids.numel() == 0:
            k = len(self.cfg.deepstack_visual_indexes)
            return {"image_embeds": torch.zeros(0, self.cfg.out_hidden_size),
                    "deepstack": torch.zeros(k, 0, self.cfg.out_hidden_size)}
        p = next(self.enc.parameters())
        merged, deep = self.enc(call.inputs["pixels"].to(self.device, p.dtype), grids)
        return {"image_embeds": merged.float().cpu(), "deepstack": torch.stack(deep).float().cpu()}


def chunk_shapes(policy, frames: int) -> list[tuple[int, int]]:
    """(left context, new frames) of each chunk ``policy`` cuts from a stream of ``frames`` frames
    (before it ends)."""
    cut, shapes = Chunker(policy, keep_rows=False), []
    for _ in range(frames):
        for info, _ in cut.push(torch.zeros(1)):  # one frame: at most one chunk, ending at what is covered
            shapes.append((info.new_from - info.start, cut.covered - info.new_from))
    return shapes


class Code2WavNode(_Stateless):
    """One chunk of frames (with its left context first) -> the new frames' samples. Chunks of
    the same length and context (every full chunk past the first few) decode as one batch."""

    def __init__(self, checkpoint: Path, ctx: NodeContext):
        kw = OmniServeConfig.parse(ctx.model_kwargs)
        p = load_parts(checkpoint, ctx.device, dtype_of(ctx), ("code2wav",))
        self.dec, self.device = p.code2wav, ctx.device
        self.graphs = None
        if kw.cuda_graphs and torch.device(ctx.device).type == "cuda":  # chunks replay CUDA graphs
            self.graphs = ChunkGraphs(self.dec, ctx.device, kw.code2wav_chunk_frames)
            self._warm(codec_policy(kw), kw.code2wav_chunk_frames, kw.code2wav_left_context_frames)

    def _warm(self, policy, chunk: int, left_context: int) -> None:
        """The graphs of one stream's chunks as the codec stream's policy cuts them, and of its
        steady chunk at every batch bucket: made now rather than at the first requests."""
        shapes = chunk_shapes(policy, left_context + 4 * chunk)
        q = self.dec.cfg.num_quantizers
        assert self.graphs is not None
        with torch.inference_mode():
            for context, new in dict.fromkeys(shapes):
                self.graphs.decode(torch.zeros(1, q, context + new, dtype=torch.int64, device=self.device), context)
            context, new = shapes[-1]
            for rows in self.graphs.buckets:
                self.graphs.decode(torch.zeros(rows, q, context + new, dtype=torch.int64, device=self.device), context)

    def forward(self, batch: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        out: list[dict[str, torch.Tensor]] = [{"audio": torch.zeros(0)} for _ in batch]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, call in enumerate(batch):
            assert call.chunk is not None, "code2wav runs in chunk walks only"
            if call.inputs["codes"].shape[0] > call.chunk.new_from - call.chunk.start:  # any new frame
                groups.setdefault((call.inputs["codes"].shape[0], call.chunk.new_from - call.chunk.start), []).append(i)
        with torch.inference_mode():
            for (_, context), rows in groups.items():
                codes = torch.stack([batch[i].inputs["codes"].T for i in rows]).to(self.device)
                wav = (self.dec.decode_chunk(codes, context) if self.graphs is None
                       else self.graphs.decode(codes, context))[:, 0].float().cpu()
                for j, i in enumerate(rows):
                    out[i] = {"audio": wav[j]}
        return out
