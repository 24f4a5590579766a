"""Code2Wav: codec frames (``num_quantizers`` codes each, 12.5 Hz) -> 24 kHz waveform.

Codes are embedded (one table, offset per quantizer) and averaged, run through a causal
sliding-window transformer, upsampled by causal transposed convs with ConvNeXt blocks, then a
causal conv decoder with SnakeBeta activations. Everything is causal, so a chunk decoded with
enough left context reproduces the whole decode's samples. transformers' ``chunked_decode`` decodes
``chunk`` new frames with up to ``left_context`` earlier ones and keeps the samples after the
context's; our streaming (``decode_chunk``) starts each chunk where the one before it stopped, so
the stream has every sample of the whole decode.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.qwen3_omni.config import Code2WavConfig
from mstar.models.qwen3_omni.layers import RMSNorm, SwiGLU, apply_rope, inv_freq, rope_1d
from mstar.services.engines.loop_graph import DEFAULT_BUCKETS, LoopGraphs


class CausalConv(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, stride: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.span = (kernel - 1) * dilation + 1
        self.pad = self.span - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        frames = (length - self.span + self.pad) / self.stride + 1
        extra = (math.ceil(frames) - 1) * self.stride + (self.span - self.pad) - length
        return self.conv(F.pad(x, (self.pad, extra)))


class CausalTransConv(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., self.trim : y.shape[-1] - self.trim]


class SnakeBeta(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.alpha.exp()[None, :, None]
        b = self.beta.exp()[None, :, None]
        return x + (1.0 / (b + 1e-9)) * torch.sin(x * a).pow(2)


class ConvNeXt(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1, self.act2 = SnakeBeta(dim), SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(cin), CausalTransConv(cin, cout, 2 * rate, rate),
                                    *(ResidualUnit(cout, d) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.block:
            x = m(x)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))


class _SlidingAttention(nn.Module):
    def __init__(self, c: Code2WavConfig):
        super().__init__()
        self.heads, self.kv, self.d = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b * t, self.heads, self.d), cos, sin).view(b, t, self.heads, self.d)
        k = apply_rope(self.k_proj(x).view(b * t, self.kv, self.d), cos, sin).view(b, t, self.kv, self.d)
        v = self.v_proj(x).view(b, t, self.kv, self.d)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _Layer(nn.Module):
    def __init__(self, c: Code2WavConfig):
        super().__init__()
        self.self_attn = _SlidingAttention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(c.hidden_size)
        self.mlp_layer_scale = LayerScale(c.hidden_size)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn_layer_scale.scale * self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp_layer_scale.scale * self.mlp(self.post_attention_layernorm(x))


class PreTransformer(nn.Module):
    def __init__(self, c: Code2WavConfig):
        super().__init__()
        self.window = c.sliding_window
        self.layers = nn.ModuleList([_Layer(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("freqs", inv_freq(c.rope_theta, c.head_dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device)
        cos, sin = rope_1d(pos.repeat(b), self.freqs)
        rel = pos[:, None] - pos[None, :]
        mask = (rel >= 0) & (rel < self.window)  # causal, the last `window` frames
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class Code2Wav(nn.Module):
    def __init__(self, c: Code2WavConfig):
        super().__init__()
        self.cfg = c
        self.code_embedding = nn.Embedding(c.codebook_size * c.num_quantizers, c.hidden_size)
        self.register_buffer("offset", torch.arange(c.num_quantizers, device="cpu").view(1, -1, 1) * c.codebook_size,
                             persistent=False)
        self.pre_transformer = PreTransformer(c)
        self.upsample = nn.ModuleList([nn.ModuleList([CausalTransConv(c.hidden_size, c.hidden_size, f, f),
                                                      ConvNeXt(c.hidden_size)]) for f in c.upsampling_ratios])
        dims = [c.decoder_dim // 2**i for i in range(len(c.upsample_rates) + 1)]
        self.decoder = nn.ModuleList([CausalConv(c.hidden_size, c.decoder_dim, 7),
                                      *(DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(c.upsample_rates)),
                                      SnakeBeta(dims[-1]), CausalConv(dims[-1], 1, 7)])

    @property
    def samples_per_frame(self) -> int:
        return self.cfg.samples_per_frame

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] (int64) -> waveform [B, 1, samples] in [-1, 1]."""
        if codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"expected {self.cfg.num_quantizers} codes a frame, got {codes.shape[1]}")
        h = self.code_embedding(codes + self.offset).mean(1)
        h = self.pre_transformer(h).transpose(1, 2)
        for up, block in self.upsample:  # type: ignore[misc]
            h = block(up(h))
        for m in self.decoder:
            h = m(h)
        return h.clamp(-1, 1)

    def decode_chunk(self, codes: torch.Tensor, context: int) -> torch.Tensor:
        """codes [B, Q, T] whose first ``context`` frames are left context -> the samples from where
        the decode of the frames before them stopped, to where this one stops.

        A decode ends ``tail`` samples short of its last frame (the transposed convolutions' trim:
        those samples need the next frames), so the next chunk's decode, which has those frames,
        starts ``tail`` samples inside its context. Chunks so cut tile the whole decode's samples
        (given enough left context); transformers' ``chunked_decode`` starts each chunk after its
        context instead, and drops each chunk's tail (``chunked_decode``, for parity, does too)."""
        wav = self(codes)
        tail = codes.shape[-1] * self.samples_per_frame - wav.shape[-1]
        return wav[..., max(0, context * self.samples_per_frame - tail) :]

    def chunked_decode(self, codes: torch.Tensor, chunk: int = 300, left_context: int = 25) -> torch.Tensor:
        """transformers' ``chunked_decode``: each chunk's samples after its context's."""
        out, start, total = [], 0, codes.shape[-1]
        while start < total:
            end = min(start + chunk, total)
            ctx = min(left_context, start)
            out.append(self(codes[..., start - ctx : end])[..., ctx * self.samples_per_frame :])
            start = end
        return torch.cat(out, dim=-1)


class ChunkGraphs:
    """``Code2Wav.decode_chunk`` replayed as CUDA graphs: a chunk's decode is hundreds of small
    kernels (its host time, eager, is several times its GPU time). One ``LoopGraphs`` of one
    iteration per left-context length, each with a graph per batch bucket and chunk length, all in
    one memory pool (a node's chunks decode one batch at a time).

    The new frames are right-padded to the next of 1, 2, 4, 8... below ``chunk`` (else ``chunk``):
    the decoder is causal, so frames after the last new one change none of its samples, and theirs
    are cut. A stream's last, partial chunk then replays a graph its full chunks made. At most
    ``max_shapes`` (context, length) shapes get graphs; others decode eagerly."""

    def __init__(self, dec: Code2Wav, device: torch.device | str, chunk: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, max_shapes: int = 32):
        self.dec, self.device, self.buckets, self.max_shapes = dec, torch.device(device), buckets, max_shapes
        self.sizes = sorted({*(1 << k for k in range(chunk.bit_length()) if 1 << k < chunk), chunk})
        self.loops: dict[int, LoopGraphs] = {}
        self.shapes: set[tuple[int, int]] = set()
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def padded(self, new: int) -> int:
        """The chunk length ``new`` new frames decode at (``new`` itself past ``chunk``)."""
        return next((s for s in self.sizes if s >= new), new)

    def decode(self, codes: torch.Tensor, context: int) -> torch.Tensor:
        """``decode_chunk(codes, context)``: codes [B, Q, context + new] -> the new frames' samples [B, 1, S]."""
        new = codes.shape[-1] - context
        size = self.padded(new)
        if (context, size) not in self.shapes and len(self.shapes) >= self.max_shapes:
            return self.dec.decode_chunk(codes, context)
        self.shapes.add((context, size))
        loop = self.loops.get(context)
        if loop is None:
            def body(s: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
                return {"wav": self.dec.decode_chunk(s["codes"], context)}
            loop = self.loops[context] = LoopGraphs(body, 1, (), self.device, self.buckets, f"code2wav@{context}",
                                                    self.pool)
        if size > new:
            codes = F.pad(codes, (0, size - new))  # code 0 after the last new frame: its samples are cut
        wav = loop.run({"codes": codes})["wav"]
        return wav[..., : wav.shape[-1] - (size - new) * self.dec.samples_per_frame]  # each padded frame's samples
