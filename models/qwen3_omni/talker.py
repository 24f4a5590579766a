"""The Talker: an MoE decoder (routed + shared experts, interleaved M-RoPE) over codec embeddings
plus projected Thinker states, whose head draws each frame's first codebook; and the code
predictor, a small dense decoder that draws the frame's other ``num_code_groups - 1`` codes.

One Talker step, as transformers' ``Qwen3OmniMoeTalkerForConditionalGeneration`` does it:
  input = codec_embedding(code0) + sum_j cp.codec_embedding[j-1](code_j) + text row
  (text row: text_projection of the next Thinker token's embedding, tts_eos once the text ended,
  tts_pad after that) -> hidden -> codec_head -> code0 of the next frame; then the code predictor
  reads [hidden, codec_embedding(code0)] and draws codes 1..G-1 one at a time (lm_head[j-1]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.qwen3_omni.config import DecoderConfig, OmniConfig
from mstar.models.qwen3_omni.layers import Decoder, inv_freq, rope_mrope
from mstar.models.qwen3_omni.sampling import Sampling

#: the code predictor's sampling when the Talker samples (transformers' top_k=50, top_p=0.8)
PREDICTOR_SAMPLING = Sampling(temperature=1.0, top_k=50, top_p=0.8)


class ResizeMLP(nn.Module):
    def __init__(self, inp: int, inner: int, out: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(inp, inner)
        self.linear_fc2 = nn.Linear(inner, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class CodePredictor(nn.Module):
    def __init__(self, cfg: DecoderConfig, groups: int):
        super().__init__()
        self.cfg, self.groups = cfg, groups
        embeds = nn.ModuleList([nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(groups - 1)])
        self.model = Decoder(cfg, "none", embeds, "codec_embedding")
        self.lm_head = nn.ModuleList([nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(groups - 1)])
        self.register_buffer("freqs", inv_freq(cfg.rope_theta, cfg.head_dim), persistent=False)
        self._loop = None

    #: CUDA graphs for the frame loop (on CUDA; a capture that fails turns them off, logged)
    cuda_graphs: bool = True

    def predict(self, hidden: torch.Tensor, code0_embed: torch.Tensor, greedy: torch.Tensor | None = None,
                generators: list[torch.Generator | None] | None = None,
                sampling: Sampling = PREDICTOR_SAMPLING) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, code0_embed [B, H] -> (codes 1..G-1 [B, G-1], the sum of their embeddings [B, H]).
        ``greedy`` [B] bool (default: every row); the other rows sample under ``sampling``, each
        from its generator (None: a shared draw)."""
        from mstar.models.qwen3_omni.predictor_loop import PredictorLoop

        b = hidden.shape[0]
        if greedy is None:
            greedy = torch.ones(b, dtype=torch.bool)
        if self._loop is None or self._loop.sampling != sampling or self._loop.device != hidden.device:
            graphs = self.cuda_graphs and hidden.device.type == "cuda"
            self._loop = PredictorLoop(self, sampling, hidden.device, graphs)
        return self._loop.run(hidden, code0_embed, greedy, generators or [None] * b)


class Talker(nn.Module):
    def __init__(self, cfg: OmniConfig):
        super().__init__()
        t = cfg.talker
        self.cfg, self.omni = t, cfg
        self.model = Decoder(t, "talker", nn.Embedding(t.vocab_size, t.hidden_size), "codec_embedding")
        self.codec_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        self.text_projection = ResizeMLP(cfg.thinker_hidden_size, t.intermediate_size, t.hidden_size)
        self.hidden_projection = ResizeMLP(cfg.thinker_hidden_size, t.intermediate_size, t.hidden_size)
        self.code_predictor = CodePredictor(cfg.code_predictor, cfg.num_code_groups)
        self.register_buffer("freqs", inv_freq(t.rope_theta, t.head_dim), persistent=False)
        # code0 may not be one of the top 1024 ids (specials), except the end of speech
        suppress = torch.zeros(t.vocab_size, dtype=torch.bool, device="cpu")
        suppress[max(0, t.vocab_size - 1024):] = True
        suppress[cfg.ids.codec_eos] = False
        self.register_buffer("suppress", suppress, persistent=False)

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """embeds [N, H], positions [3, N] -> final hidden [N, H]."""
        cos, sin = rope_mrope(positions, self.freqs, self.cfg.mrope_section)
        h, _ = self.model(embeds, cos, sin, ctx)
        return h

    def code0_logits(self, hidden: torch.Tensor, seen: torch.Tensor | None = None,
                     penalty: torch.Tensor | None = None) -> torch.Tensor:
        """The codec head's logits with the reference's processors: repetition penalty (``penalty``
        [B]) on the code0s each row drew so far (``seen`` [B, vocab] bool), then the special ids
        suppressed. One pass for the batch: no per-row work."""
        logits = self.codec_head(hidden).float()
        if seen is not None and penalty is not None:
            p = penalty.to(logits)[:, None]
            logits = torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)
        return logits.masked_fill(self.suppress, float("-inf"))
