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

from mstar.models.qwen3_omni.layers import _attn_in, _rms, rope_1d
from mstar.models.qwen3_omni.sampling import Sampling, _warp
from mstar.services.engines.compiled import compiled, owned
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
        # the rotary tables of the frame's positions 0..G-1 (iteration i's row: no kernels in the loop)
        self.cos, self.sin = rope_1d(torch.arange(self.groups, device=device), predictor.freqs)
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
        """Iteration ``i``: each layer as two pieces around its attention (``_attn_in``, ``_dense_out``),
        then the codebook's draw (``_draw``); under ``compile_layers`` (``layer.compiled``: on a GPU)
        each piece torch.compile'd, else run as it is."""
        p = self.p
        out = dict(s)
        x = s["x"]
        cos, sin = self.cos[i : i + 1], self.sin[i : i + 1]  # broadcast over the rows
        for n, layer in enumerate(p.model.layers):
            a, n1, n2, m, backend = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm, layer.mlp, layer.compiled
            x = owned(x)  # (a compiled piece's guards see a view's base: services/engines/compiled.py)
            q, k, v = _piece(_attn_in, backend)(x, cos, sin, n1.weight, n1.eps, a.q_proj.weight, a.k_proj.weight,
                                                a.v_proj.weight, a.q_norm.weight, a.k_norm.weight, a.heads, a.kv_heads,
                                                a.head_dim)
            kc, vc = s[f"k{n}"].clone(), s[f"v{n}"].clone()  # (no host tensors inside a capture)
            kc[:, :, i], vc[:, :, i] = k, v
            out[f"k{n}"], out[f"v{n}"] = kc, vc
            att = F.scaled_dot_product_attention(q[:, :, None], kc[:, :, : i + 1], vc[:, :, : i + 1], enable_gqa=True)
            o = a.o_proj(att[:, :, 0].reshape(x.shape[0], -1))
            x = _piece(_dense_out, backend)(x, o, n2.weight, n2.eps, m.gate_proj.weight, m.up_proj.weight,
                                            m.down_proj.weight)
        if i == 0:
            out["x"] = s["e0"]
            return out
        backend = p.model.layers[0].compiled
        code = _piece(_draw, backend)(owned(x), p.model.norm.weight, p.model.norm.eps, p.lm_head[i - 1].weight,
                                      s["noise"][:, i - 1], s["greedy"], self.sampling)
        emb = p.model.codec_embedding[i - 1](code)
        codes = s["codes"].clone()
        codes[:, i - 1] = code
        out["codes"] = codes
        out["total"], out["x"] = s["total"] + emb, emb
        return out


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The code predictor's batch buckets up to the first that holds ``max_num_seqs`` rows."""
    top = next((b for b in BUCKETS if b >= max_num_seqs), BUCKETS[-1])
    return tuple(b for b in BUCKETS if b <= top)


def warm_predictor(predictor, dtype: torch.dtype, device: torch.device | str, max_rows: int) -> None:
    """Run the code predictor's frame loop once at every batch bucket that ``max_rows`` rows (the
    Talker's most sequences) can reach, as the Talker's engine runs it (inference mode, greedy and
    sampled rows): its pieces under ``compile_layers`` are compiled and, on CUDA, each bucket's graph
    captured before any engine steps (torch.compile is not thread-safe: services/engines/compiled.py)."""
    h = predictor.cfg.hidden_size
    with torch.inference_mode():
        for rows in batch_buckets(max_rows):
            x = torch.zeros(rows, h, dtype=dtype, device=device)
            greedy = torch.arange(rows, device=device) % 2 == 0
            predictor.predict(x, x, greedy, [None] * rows)


# -- the frame loop's pieces (torch.compile'd under ``compile_layers``; services/engines/compiled.py) --

def _piece(fn, backend):
    """``fn`` as a layer under ``compile_layers`` runs it (``backend``), or as it is (None)."""
    return fn if backend is None else compiled(fn, backend)


def _dense_out(x, o, norm_w, eps: float, gate_w, up_w, down_w):
    """A dense layer after its attention: the residual, the norm, the SwiGLU MLP, the residual."""
    x = x + o
    h = _rms(x, norm_w, eps)
    return x + F.linear(F.silu(F.linear(h, gate_w)) * F.linear(h, up_w), down_w)


def _draw(x, norm_w, eps: float, head_w, noise, greedy, sampling: Sampling):
    """The final norm and a codebook's head, then its code: argmax for greedy rows, else Gumbel-max
    over the warped log-probabilities (``noise``: that codebook's Gumbel noise)."""
    logits = F.linear(_rms(x, norm_w, eps), head_w).float()
    noisy = (torch.log_softmax(_warp(logits, sampling), -1) + noise).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), noisy)
