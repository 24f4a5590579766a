"""The Thinker's language model: a Qwen3 MoE decoder over token and media embeddings, with
interleaved M-RoPE positions ([3, N]: temporal, height, width) and DeepStack visual features
added after its first layers. Its ``prefill`` / ``decode`` run over the slot cache's contexts.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.models.qwen3_omni.config import DecoderConfig
from mstar.models.qwen3_omni.layers import Decoder, inv_freq, rope_mrope


class Thinker(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg, "thinker", nn.Embedding(cfg.vocab_size, cfg.hidden_size), "embed_tokens")
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("freqs", inv_freq(cfg.rope_theta, cfg.head_dim), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def prompt_embeds(self, ids: torch.Tensor, media: dict[int, torch.Tensor]) -> torch.Tensor:
        """Token embeddings with each placeholder id's rows replaced by its media rows, in order."""
        embeds = self.embed(ids)
        for token, rows in media.items():
            where = (ids == token).nonzero()[:, 0]
            if where.numel() != rows.shape[0]:
                raise ValueError(f"{where.numel()} placeholders of id {token}, {rows.shape[0]} media rows")
            embeds = embeds.index_copy(0, where, rows.to(embeds.device, embeds.dtype))
        return embeds

    @staticmethod
    def deepstack_rows(ids: torch.Tensor, visual_ids: tuple[int, ...], feats: list[torch.Tensor]):
        """The ``deepstack`` argument: the visual placeholders' rows and the features added there."""
        if not feats:
            return None
        rows = torch.isin(ids, torch.tensor(visual_ids, device=ids.device)).nonzero()[:, 0]
        return rows, feats

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, ctx, capture: int | None = None,
                deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None):
        """embeds [N, H], positions [3, N] -> (final hidden [N, H], layer ``capture``'s output or None)."""
        cos, sin = rope_mrope(positions, self.freqs, self.cfg.mrope_section)
        return self.model(embeds, cos, sin, ctx, capture, deepstack)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
