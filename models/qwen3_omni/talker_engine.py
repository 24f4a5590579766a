"""The Talker's sequence engine (the engine contract, ``mstar.models.engine.Engine``) over its MoE
decoder, code predictor and a slot KV cache of its own.

Unlike a text LLM, each Talker step reads an input the graph supplies: the next row of the
Thinker's text stream (or none once that stream ended). So every call of the Talker's loop hands
the engine work: ``TalkerStart`` (its prompt, once) or ``TalkerFeed`` (one step), and each work
item is answered by one output: the frame's first code (``token_id``) and, unless it is the end
of speech, the whole frame (``extra["frame"]``, ``num_code_groups`` codes). The feeds of all
requests waiting when a step starts run as one batched decode and one batched code prediction
(on CUDA each a graph replay: ``decode_graphs.py``, ``predictor_loop.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mstar.metrics import KvStats
from mstar.models.engine import Engine
from mstar.models.qwen3_omni.cache import Decode, PrefillBatch, SlotCache
from mstar.models.qwen3_omni.decode_graphs import DecodeGraphs
from mstar.models.qwen3_omni.positions import decode_positions
from mstar.models.qwen3_omni.sampling import Sampling, sample
from mstar.models.qwen3_omni.talker import Talker
from mstar.models.qwen3_omni.thinker_engine import OmniOut
from mstar.services.engines.batch import h2d
from mstar.services.engines.sequence import SeqStatus


@dataclass(frozen=True)
class TalkerStart:
    thinker_rows: torch.Tensor  # [U + 3, thinker hidden]: the user turn's rows, then "<|im_start|>assistant\n"
    mm: torch.Tensor  # [U + 3] bool: rows that are media states (hidden_projection), else embeddings
    first_text: torch.Tensor  # [thinker hidden]: the embedding of the Thinker's first token
    speaker: int  # codec id of the voice
    positions: torch.Tensor  # [3, U + 9]
    delta: int
    sampling: Sampling
    max_tokens: int
    repetition_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # never draw the end of speech (benchmarks)


@dataclass(frozen=True)
class TalkerFeed:
    text: torch.Tensor | None  # [thinker hidden] the next text row; None: the text ended (tts_pad)


@dataclass(eq=False)
class _Seq:
    rid: str
    start: TalkerStart
    slot: int = -1  # -1: waiting for a free slot
    length: int = 0
    code0: list[int] = field(default_factory=list)
    next_codec: torch.Tensor | None = None  # the summed codec embeddings of the last frame
    generator: torch.Generator | None = None


class TalkerEngine(Engine[TalkerStart | TalkerFeed]):
    def __init__(self, model: Talker, specials: torch.Tensor, max_num_seqs: int, max_seq_len: int,
                 cuda_graphs: bool = True):
        """``specials`` [3, thinker hidden]: the Thinker's embeddings of tts_bos, tts_eos, tts_pad.
        ``cuda_graphs``: decode passes replay CUDA graphs (on CUDA)."""
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        c = model.cfg
        self.cache = SlotCache(c.num_layers, max_num_seqs, max_seq_len, c.num_kv_heads, c.head_dim, p.device, p.dtype)
        self.decode = DecodeGraphs(self.cache, self._decode_forward, p.device, max_num_seqs, cuda_graphs, "talker")
        with torch.inference_mode():
            self.tts_bos, self.tts_eos, self.tts_pad = model.text_projection(specials.to(self.device, self.dtype))
        self.ids = model.omni.ids
        self.seen = torch.zeros(max_num_seqs, c.vocab_size, dtype=torch.bool, device=self.device)  # code0s drawn, per slot
        self.seqs: dict[str, _Seq] = {}
        self.starts: list[str] = []  # sequences waiting for a slot and their prefill, in order
        self.feeds: dict[str, TalkerFeed] = {}
        self.refused: list[OmniOut] = []
        self.steps = 0

    def submit(self, rid: str, work: TalkerStart | TalkerFeed) -> None:
        """A start waits for a free slot (admitted in order); work the engine cannot take is
        answered, aborted with the reason, by the next step."""
        why = None
        if isinstance(work, TalkerStart):
            if rid in self.seqs:
                why = f"request {rid} already has a Talker sequence"
            elif work.positions.shape[1] + work.max_tokens > self.cache.max_len:
                why = f"Talker prompt + max_tokens exceeds max_seq_len={self.cache.max_len}"
            else:
                gen = None  # a seeded sampled request draws from its own generator; unseeded ones draw together
                if not work.sampling.greedy and work.seed is not None:
                    gen = torch.Generator(device=self.device)
                    gen.manual_seed(work.seed)
                self.seqs[rid] = _Seq(rid, work, generator=gen)
                self.starts.append(rid)
        elif rid not in self.seqs or self.seqs[rid].next_codec is None:
            why = f"request {rid}: a Talker step without a running sequence"
        else:
            self.feeds[rid] = work
        if why is not None:
            self.refused.append(OmniOut(rid, None, SeqStatus.FINISHED_ABORTED, error=f"refused by the Talker: {why}"))

    def release(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        self.starts = [r for r in self.starts if r != rid]
        self.feeds.pop(rid, None)
        if seq is not None and seq.slot >= 0:
            self.cache.give_back(seq.slot)

    @property
    def has_work(self) -> bool:
        return bool(self.starts) or bool(self.feeds) or bool(self.refused)

    @torch.inference_mode()
    def step(self) -> list[OmniOut]:
        refused, self.refused = self.refused, []
        starts = []
        while self.starts and self.cache.num_free:
            s = self.seqs[self.starts.pop(0)]
            s.slot = self.cache.take()
            self.seen[s.slot] = False
            starts.append(s)
        feeds, self.feeds = self.feeds, {}
        rows: list[tuple[_Seq, torch.Tensor]] = list(zip(starts, self._prefill(starts), strict=True)) if starts else []
        if feeds:
            seqs = [self.seqs[r] for r in feeds]
            texts = [f.text for f in feeds.values() if f.text is not None]  # one upload, one projection
            projected = iter(())
            if texts:  # host rows (served: from the wire) go up together; rows already on a device each
                up = h2d(torch.stack(texts), self.device) if all(t.device.type == "cpu" for t in texts) \
                    else torch.stack([h2d(t, self.device) for t in texts])
                projected = iter(self.model.text_projection(up.to(self.dtype)))
            text = torch.stack([self.tts_pad if f.text is None else next(projected) for f in feeds.values()])
            embeds = torch.stack([s.next_codec for s in seqs]) + text  # type: ignore[misc]
            pos = torch.cat([decode_positions(s.start.positions.shape[1], s.start.delta, 1, len(s.code0) - 1)
                             for s in seqs], 1)
            hidden = self.decode.run([s.slot for s in seqs], [s.length for s in seqs], pos, embeds=embeds)["hidden"]
            for s, h in zip(seqs, hidden, strict=True):
                s.length += 1
                rows.append((s, h))
        self.steps += 1
        return refused + (self._finish(rows) if rows else [])

    def _decode_forward(self, s: dict[str, torch.Tensor], ctx: Decode) -> dict[str, torch.Tensor]:
        """The decode graphs' forward (inside a capture: no host syncs)."""
        return {"hidden": self.model(s["embeds"], s["positions"], ctx)}

    def _prompt(self, s: _Seq) -> torch.Tensor:
        """The Talker's prompt embeddings: the user turn (media rows through hidden_projection, text
        through text_projection), "<|im_start|>assistant\n", then 4 rows of tts_pad over the
        no-think codes and the voice, tts_bos over codec_pad, the first text row over codec_bos."""
        w, m = s.start, self.model
        src = h2d(w.thinker_rows, self.device).to(self.dtype)
        mm = h2d(w.mm, self.device)
        proj = torch.where(mm[:, None], m.hidden_projection(src), m.text_projection(src))
        i = self.ids
        codec = m.codec_embed(h2d(torch.tensor([i.codec_nothink, i.codec_think_bos, i.codec_think_eos, w.speaker,
                                                i.codec_pad, i.codec_bos]), self.device))
        tail = torch.cat([self.tts_pad.expand(4, -1), self.tts_bos[None],
                          m.text_projection(h2d(w.first_text, self.device).to(self.dtype))[None]]) + codec
        return torch.cat([proj, tail])

    def _prefill(self, seqs: list[_Seq]) -> list[torch.Tensor]:
        """Every started prompt in one pass -> each one's last hidden state."""
        prompts = [self._prompt(s) for s in seqs]
        lengths = [p.shape[0] for p in prompts]
        ctx = PrefillBatch(self.cache, [s.slot for s in seqs], lengths, self.device)
        positions = h2d(torch.cat([s.start.positions for s in seqs], dim=1), self.device)
        hidden = self.model(torch.cat(prompts), positions, ctx)
        out, at = [], 0
        for s, n in zip(seqs, lengths, strict=True):
            s.length = n
            at += n
            out.append(hidden[at - 1])
        return out

    def _finish(self, rows: list[tuple[_Seq, torch.Tensor]]) -> list[OmniOut]:
        """Code0 of each row, then the residual codes of every row that may go on, all queued on the
        device before the one host sync of the step (the codes' copy): the frames of rows whose
        code0 turns out to be the end of speech are computed and dropped, rather than the host
        waiting for code0 between the two."""
        seqs = [s for s, _ in rows]
        hidden = torch.stack([h for _, h in rows])
        dev = self.device
        slots = h2d(torch.tensor([s.slot for s in seqs]), dev)
        penalty = h2d(torch.tensor([s.start.repetition_penalty for s in seqs]), dev)
        logits = self.model.code0_logits(hidden, self.seen[slots], penalty)
        no_eos = [k for k, s in enumerate(seqs) if s.start.ignore_eos]
        if no_eos:
            logits[h2d(torch.tensor(no_eos), dev), self.ids.codec_eos] = float("-inf")
        drawn = sample(logits, [s.start.sampling for s in seqs], [s.generator for s in seqs])
        self.seen.index_put_((slots, drawn), torch.ones_like(drawn, dtype=torch.bool))  # (``= True`` uploads a host scalar: a sync)
        going = [k for k, s in enumerate(seqs) if len(s.code0) + 1 < s.start.max_tokens]  # before code0 is known
        whole = None
        if going:
            picked = h2d(torch.tensor(going), dev) if len(going) < len(seqs) else None  # (a list index would sync)
            c0, h = (drawn, hidden) if picked is None else (drawn[picked], hidden[picked])
            e0 = self.model.codec_embed(c0)
            # each row's residual codes sample as its code0 does (greedy rows stay greedy)
            greedy = h2d(torch.tensor([seqs[k].start.sampling.greedy for k in going]), dev)
            rest, rest_sum = self.model.code_predictor.predict(h, e0, greedy, [seqs[k].generator for k in going])
            whole = torch.cat([c0[:, None], rest], dim=1)
            for j, k in enumerate(going):
                seqs[k].next_codec = e0[j] + rest_sum[j]
        # the step's one sync: code0 of every row, then the going rows' frames
        host = torch.cat([drawn, whole.reshape(-1)]).cpu() if whole is not None else drawn.cpu()
        code0 = host[: len(seqs)].tolist()
        frames: dict[int, torch.Tensor] = {}
        if whole is not None:
            codes = host[len(seqs):].view(len(going), -1)
            frames = {k: codes[j] for j, k in enumerate(going) if code0[k] != self.ids.codec_eos}
        outs = []
        for k, s in enumerate(seqs):
            s.code0.append(code0[k])
            status = SeqStatus.RUNNING
            if code0[k] == self.ids.codec_eos:
                status = SeqStatus.FINISHED_STOPPED
            elif k not in frames:
                status = SeqStatus.FINISHED_LENGTH
            if status.finished:
                self.release(s.rid)
            outs.append(OmniOut(s.rid, code0[k], status, extra={"frame": frames.get(k)}))
        return outs

    def kv_stats(self) -> KvStats:
        return KvStats(self.cache.num_slots - self.cache.num_free, self.cache.num_free, 0)

    def close(self) -> None:
        pass

    def follow(self) -> None:
        raise TypeError("the Talker engine does not run tensor-parallel")

    def exit_reason(self) -> str | None:
        return None
