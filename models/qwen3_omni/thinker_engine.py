"""The Thinker's sequence engine (the engine contract, ``mstar.models.engine.Engine``) over the MoE
model and a slot KV cache of its own.

A step prefills the sequences submitted since the last one (one pass each: token and media
embeddings, DeepStack rows, M-RoPE positions) and decodes every other running sequence in one
batched pass (on CUDA a graph replay, ``decode_graphs.py``). Each output carries, besides the
sampled token, the embedding of the token the step read (what the Talker's text stream is made
of) and, for a prefill, the rows the Talker's prompt needs (token embeddings, or the
``accept_hidden_layer`` state for media rows).

Tensor-parallel (``tp``, a model from ``thinker_tp.py``): rank 0 is this engine, scheduling and
sampling; the other ranks ``follow``. Each pass (``_prefill_pass``, ``_decode_pass``) is sent to
them as its host inputs (token ids, media rows, positions, slots, lengths) over the command
group and run on every rank, each over its own slot cache of its KV heads (and its own decode
graphs: the same inputs pick the same graph on every rank).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from mstar.metrics import KvStats
from mstar.models.engine import Engine
from mstar.models.qwen3_omni.cache import Decode, PrefillBatch, SlotCache
from mstar.models.qwen3_omni.decode_graphs import DecodeGraphs
from mstar.models.qwen3_omni.positions import decode_positions
from mstar.models.qwen3_omni.sampling import Sampling, sample
from mstar.models.qwen3_omni.thinker import Thinker
from mstar.services.engines.batch import h2d
from mstar.services.engines.sequence import SeqStatus

log = logging.getLogger(__name__)


class OmniOut(NamedTuple):
    """One step's output for one request (the fields ``EngineDriver`` reads, plus ``extra``)."""

    request_id: str
    token_id: int | None
    status: SeqStatus
    kv: Any = None
    error: str | None = None
    extra: dict | None = None

    @property
    def finished(self) -> bool:
        return self.status > SeqStatus.PREEMPTED


@dataclass(frozen=True)
class ThinkerStart:
    prompt_ids: torch.Tensor  # [L] int64
    positions: torch.Tensor  # [3, L] M-RoPE positions
    delta: int  # decode token i sits at L + i + delta
    sampling: Sampling
    max_tokens: int
    stop_ids: tuple[int, ...]
    media: dict[int, torch.Tensor] = field(default_factory=dict)  # placeholder token id -> rows for it
    deepstack: list[torch.Tensor] = field(default_factory=list)  # per layer, rows for the visual placeholders
    visual_ids: tuple[int, ...] = ()  # placeholder ids DeepStack rows go to (image, video)
    talker_rows: torch.Tensor | None = None  # prompt rows the Talker reads
    talker_mm: torch.Tensor | None = None  # of those, which read the captured layer (media rows)
    seed: int | None = None


@dataclass(eq=False)
class _Seq:
    rid: str
    work: ThinkerStart
    slot: int = -1  # -1: waiting for a free slot
    length: int = 0  # tokens with K/V in the cache
    last: int = 0  # the last sampled token (the next step's input)
    outputs: int = 0
    generator: torch.Generator | None = None


class ThinkerEngine(Engine[ThinkerStart]):
    def __init__(self, model: Thinker, capture_layer: int, max_num_seqs: int, max_seq_len: int,
                 max_prefill_tokens: int = 8192, tp=None, cuda_graphs: bool = True):
        """``max_prefill_tokens``: prompts admitted in one step add up to at most this many tokens
        (one longer prompt still goes alone). ``tp``: this process's ``TensorParallel`` rank.
        ``cuda_graphs``: decode passes replay CUDA graphs (on CUDA)."""
        self.tp = tp if tp is not None and tp.size > 1 else None
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        c = model.cfg
        self.cache = SlotCache(c.num_layers, max_num_seqs, max_seq_len, c.num_kv_heads, c.head_dim, p.device, p.dtype)
        self.decode = DecodeGraphs(self.cache, self._decode_forward, p.device, max_num_seqs, cuda_graphs, "thinker")
        self.capture, self.max_prefill_tokens = capture_layer, max_prefill_tokens
        self.waiting: list[_Seq] = []  # submitted, no slot yet (admitted in order as slots free up)
        self.running: dict[str, _Seq] = {}
        self.refused: list[OmniOut] = []  # answered with the next step
        self.steps = 0

    # -- the driver's surface ------------------------------------------------------------------
    def submit(self, rid: str, work: ThinkerStart) -> None:
        """Queue a sequence; one the engine cannot take is answered, aborted with the reason, by
        the next step (no exception reaches the driver's step)."""
        n = work.prompt_ids.numel()
        why = None
        if rid in self.running or any(s.rid == rid for s in self.waiting):
            why = f"request {rid} already has a Thinker sequence"
        elif n + work.max_tokens > self.cache.max_len:
            why = f"prompt of {n} tokens + max_tokens={work.max_tokens} exceeds max_seq_len={self.cache.max_len}"
        if why is not None:
            self.refused.append(OmniOut(rid, None, SeqStatus.FINISHED_ABORTED, error=f"refused by the Thinker: {why}"))
            return
        gen = None  # a seeded sampled request draws from its own generator; unseeded ones draw together
        if not work.sampling.greedy and work.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(work.seed)
        self.waiting.append(_Seq(rid, work, generator=gen))

    def release(self, rid: str) -> None:
        self.waiting = [s for s in self.waiting if s.rid != rid]
        seq = self.running.pop(rid, None)
        if seq is not None:
            self.cache.give_back(seq.slot)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running) or bool(self.refused)

    @torch.inference_mode()
    def step(self) -> list[OmniOut]:
        outs, self.refused = self.refused, []
        decoding = list(self.running.values())
        admitted: list[tuple[_Seq, tuple]] = []
        budget = self.max_prefill_tokens
        while self.waiting and self.cache.num_free and (not admitted or self.waiting[0].work.prompt_ids.numel() <= budget):
            s = self.waiting.pop(0)
            budget -= s.work.prompt_ids.numel()
            s.slot = self.cache.take()
            self.running[s.rid] = s
            try:  # this request's inputs (media rows, lengths): a bad one aborts alone
                admitted.append((s, self._inputs(s)))
            except Exception as e:
                self.release(s.rid)
                outs.append(OmniOut(s.rid, None, SeqStatus.FINISHED_ABORTED,
                                    error=f"Thinker prefill failed: {type(e).__name__}: {e}"))
        if admitted:
            outs += self._prefill(admitted)
        if decoding:
            outs += self._decode(decoding)
        self.steps += 1
        return outs

    def kv_stats(self) -> KvStats:
        return KvStats(self.cache.num_slots - self.cache.num_free, self.cache.num_free, 0)

    def close(self) -> None:
        if self.tp is not None:
            self.tp.stop_followers()

    def follow(self) -> None:
        """A rank past 0: run the leader's passes until its ``close``."""
        if self.tp is None:
            raise RuntimeError("follow() is for tensor-parallel ranks past 0")
        self.tp.follow(lambda command: getattr(self, command[0])(*command[1]), "Thinker pass")

    def _mirrored(self, name: str, *args):
        """Run pass ``name`` here and, under tensor parallelism, on every follower."""
        if self.tp is not None:
            self.tp.send((name, args))
        return getattr(self, name)(*args)

    def exit_reason(self) -> str | None:
        return None

    # -- passes ------------------------------------------------------------------------------
    def _inputs(self, s: _Seq) -> tuple:
        """(prompt ids, media rows, positions, DeepStack (rows, features) or None) of one sequence,
        checked here (a bad one fails alone, before any rank runs the pass)."""
        w = s.work
        for token, rows in w.media.items():
            n = int((w.prompt_ids == token).sum())
            if rows.ndim != 2 or rows.shape[1] != self.model.cfg.hidden_size:
                raise ValueError(f"media rows of id {token} have shape {tuple(rows.shape)}, expected [n, {self.model.cfg.hidden_size}]")
            if n != rows.shape[0]:
                raise ValueError(f"{n} placeholders of id {token}, {rows.shape[0]} media rows")
        deep = self.model.deepstack_rows(w.prompt_ids, w.visual_ids, list(w.deepstack))
        if deep is not None and any(f.shape[0] != deep[0].numel() for f in deep[1]):
            raise ValueError(f"{deep[0].numel()} visual placeholders, DeepStack rows {[f.shape[0] for f in deep[1]]}")
        return w.prompt_ids, w.media, w.positions, deep

    def _prefill_pass(self, inputs: list[tuple], slots: list[int], capture: int | None):
        """Prompts [(ids, media, positions, deep)] -> (their last rows' logits, embeddings,
        captured layer, each prompt's first row)."""
        lengths = [inp[0].numel() for inp in inputs]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        dev = self.device
        embeds = torch.cat([self.model.prompt_embeds(h2d(ids, dev), media) for ids, media, _, _ in inputs])
        positions = h2d(torch.cat([inp[2] for inp in inputs], dim=1), dev)
        deep_rows = [h2d(inp[3][0], dev) + at for inp, at in zip(inputs, starts, strict=True) if inp[3] is not None]
        deep_feats = [inp[3][1] for inp in inputs if inp[3] is not None]
        deep = (torch.cat(deep_rows), [torch.cat(f).to(dev, self.dtype) for f in zip(*deep_feats, strict=True)]) \
            if deep_rows else None
        ctx = PrefillBatch(self.cache, slots, lengths, dev)
        hidden, captured = self.model(embeds, positions, ctx, capture, deep)
        last = h2d(torch.tensor([a + n - 1 for a, n in zip(starts, lengths, strict=True)]), dev)
        return self.model.logits(hidden[last]), embeds, captured, starts

    def _decode_pass(self, ids: torch.Tensor, positions: torch.Tensor, slots: list[int], lengths: list[int]):
        """One new token per sequence -> (logits, the tokens' embeddings)."""
        out = self.decode.run(slots, lengths, positions, ids=ids)
        return out["logits"], out["embeds"]

    def _decode_forward(self, s: dict[str, torch.Tensor], ctx: Decode) -> dict[str, torch.Tensor]:
        """The decode graphs' forward (inside a capture: no host syncs)."""
        embeds = self.model.embed(s["ids"])
        hidden, _ = self.model(embeds, s["positions"], ctx)
        return {"logits": self.model.logits(hidden), "embeds": embeds}

    def _prefill(self, batch: list[tuple[_Seq, tuple]]) -> list[OmniOut]:
        """Every admitted prompt in one pass (one attention call per layer over the padded batch)."""
        seqs = [s for s, _ in batch]
        capture = self.capture if any(s.work.talker_rows is not None for s in seqs) else None
        logits, embeds, captured, starts = self._mirrored("_prefill_pass", [inp for _, inp in batch],
                                                          [s.slot for s in seqs], capture)
        tokens = self._sample(logits, seqs).tolist()
        lengths = [inp[0].numel() for _, inp in batch]
        outs = []
        for s, at, n, t in zip(seqs, starts, lengths, tokens, strict=True):
            s.length = n
            extra: dict[str, torch.Tensor] = {}
            w = s.work
            if w.talker_rows is not None:
                rows = h2d(w.talker_rows, self.device) + at
                mm = h2d(w.talker_mm, self.device) if w.talker_mm is not None else torch.zeros_like(rows, dtype=torch.bool)
                extra["talker_prompt"] = torch.where(mm[:, None], captured[rows], embeds[rows])  # type: ignore[index]
            outs.append(self._advance(s, int(t), extra))
        return outs

    def _decode(self, seqs: list[_Seq]) -> list[OmniOut]:
        ids = torch.tensor([s.last for s in seqs])
        pos = torch.cat([decode_positions(s.work.prompt_ids.numel(), s.work.delta, 1, s.outputs - 1) for s in seqs], 1)
        logits, embeds = self._mirrored("_decode_pass", ids, pos, [s.slot for s in seqs], [s.length for s in seqs])
        tokens = self._sample(logits, seqs).tolist()
        rows = embeds.float().cpu()  # the Talker's text rows: one copy for the step
        outs = []
        for i, (s, t) in enumerate(zip(seqs, tokens, strict=True)):
            s.length += 1
            outs.append(self._advance(s, int(t), {"input_embed": rows[i]}))
        return outs

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        return sample(logits.float(), [s.work.sampling for s in seqs], [s.generator for s in seqs])

    def _advance(self, s: _Seq, token: int, extra: dict) -> OmniOut:
        s.last, s.outputs = token, s.outputs + 1
        status = SeqStatus.RUNNING
        if token in s.work.stop_ids:
            status = SeqStatus.FINISHED_STOPPED
        elif s.outputs >= s.work.max_tokens:
            status = SeqStatus.FINISHED_LENGTH
        if status.finished:
            self.running.pop(s.rid, None)
            self.cache.give_back(s.slot)
        else:
            self.running[s.rid] = s
        return OmniOut(s.rid, token, status, extra=extra)
