"""The code predictor's frame as one fixed-shape loop (``services/engines/loop_graph.py``): on CUDA
all of a frame's steps replay as one CUDA graph per batch bucket (the predictor is ~75% of a
Talker step's kernels when eager), on a CPU the same body runs eagerly.

Iteration i feeds one token at position i: the Talker's hidden state (i = 0), the code0 embedding
(i = 1), then the embedding of the code drawn at the previous iteration; from i = 1 it draws code
i with ``lm_head[i-1]``. K/V live in fixed ``[B, kv, G, d]`` buffers carried through the loop.
Sampled rows draw by Gumbel-max (argmax of the warped log-probabilities plus noise the caller
makes from each request's own generator: the same distribution as a multinomial draw), greedy
rows by argmax, in the same graph.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from mstar.models.qwen3_omni.layers import apply_rope, rope_1d
from mstar.models.qwen3_omni.sampling import Sampling, _warp
from mstar.services.engines.loop_graph import CaptureFailed, LoopGraphs

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def gumbel(rows: int, shape: tuple[int, ...], generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[rows, *shape] Gumbel noise; row r from ``generators[r]`` (None: all such rows in one draw)."""
    out = torch.rand((rows, *shape), device=device)  # the unseeded rows' draw (no host index: no sync)
    for r, g in enumerate(generators):
        if g is not None:
            out[r] = torch.rand(shape, device=device, generator=g)
    return -torch.log(-torch.log(out.clamp_(1e-20, 1.0 - 1e-7)))


class PredictorLoop:
    def __init__(self, predictor, sampling: Sampling, device: torch.device, graphs: bool):
        self.p, self.sampling, self.device = predictor, sampling, device
        self.groups = predictor.groups
        cfg = predictor.cfg
        self.kv, self.d = cfg.num_kv_heads, cfg.head_dim
        carried = ("x", "codes", "total", *(f"{c}{i}" for i in range(cfg.num_layers) for c in "kv"))
        self.loop = LoopGraphs(self._body, self.groups, carried, device, BUCKETS if graphs else (), name="code_predictor")

    def run(self, hidden: torch.Tensor, e0: torch.Tensor, greedy: torch.Tensor,
            generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
        b, g, cfg = hidden.shape[0], self.groups, self.p.cfg
        noise = gumbel(b, (g - 1, cfg.vocab_size), generators, hidden.device)
        cache = torch.zeros(b, self.kv, g, self.d, device=hidden.device, dtype=hidden.dtype)
        inputs = {"x": hidden, "e0": e0, "greedy": greedy.to(hidden.device), "noise": noise,
                  "codes": torch.zeros(b, g - 1, dtype=torch.int64, device=hidden.device),
                  "total": torch.zeros_like(hidden),
                  **{f"{c}{i}": cache for i in range(cfg.num_layers) for c in "kv"}}
        try:
            out = self.loop.run(inputs)
        except CaptureFailed as e:  # a CUDA graph capture failed: the same loop, eagerly, from now on
            if self.loop.buckets == ():
                raise
            log.warning("code predictor: CUDA graphs off (%s)", e)
            self.loop.buckets = ()
            out = self.loop.run(inputs)
        return out["codes"], out["total"]

    def _body(self, s: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        p = self.p
        out = dict(s)
        x = s["x"]
        cos, sin = rope_1d(torch.full((x.shape[0],), i, device=x.device), p.freqs)
        for n, layer in enumerate(p.model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_norm(a.q_proj(h).view(-1, a.heads, a.head_dim))
            k = a.k_norm(a.k_proj(h).view(-1, a.kv_heads, a.head_dim))
            v = a.v_proj(h).view(-1, a.kv_heads, a.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kc, vc = s[f"k{n}"].clone(), s[f"v{n}"].clone()  # (no host tensors inside a capture)
            kc[:, :, i], vc[:, :, i] = k, v
            out[f"k{n}"], out[f"v{n}"] = kc, vc
            att = F.scaled_dot_product_attention(q[:, :, None], kc[:, :, : i + 1], vc[:, :, : i + 1], enable_gqa=True)
            x = x + a.o_proj(att[:, :, 0].reshape(x.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i == 0:
            out["x"] = s["e0"]
            return out
        logits = p.lm_head[i - 1](p.model.norm(x)).float()
        noisy = (torch.log_softmax(_warp(logits, self.sampling), -1) + s["noise"][:, i - 1]).argmax(-1)
        code = torch.where(s["greedy"], logits.argmax(-1), noisy)
        emb = p.model.codec_embedding[i - 1](code)
        codes = s["codes"].clone()
        codes[:, i - 1] = code
        out["codes"] = codes
        out["total"], out["x"] = s["total"] + emb, emb
        return out
