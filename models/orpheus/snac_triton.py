"""SNAC's decode path in channels-last layout with fused Triton kernels (``snac_kernels: triton``).

The module decoder (`snac.py`) runs ~320 kernels a window decode: every Snake is five
elementwise passes, every residual unit a dozen launches. At serving batch sizes the windows'
activations (up to 64-128 channels x 2,048 samples a frame) make those passes bandwidth-bound,
and at small batches the launches dominate. Here activations are [B, T, C] (channels last) and
each residual unit ``x + conv1x1(snake(dwconv7(snake(x))))`` is three launches:

- ``_add_snake`` resolves the residual stream x, kept as the lazy sum ``a + s * z`` of the
  previous unit's input and 1x1 output (s: the NoiseBlock's per-sample noise, or 1), writes it,
  and writes u = snake(x): one Snake per element (a Snake per conv tap, 7x the ``sin``s, made
  the conv kernel compute-bound);
- ``_dwconv``: the depthwise dilated conv of u, its bias and the second Snake;
- the 1x1 conv is a GEMM over [B*T, C] with its bias (cuBLAS), whose output z stays unsummed
  until the next ``_add_snake`` reads it.

The transposed conv of each decoder block is a GEMM to every output phase at once ([B*T, 2r*C])
followed by ``_fold`` (each output sample sums its two overlapping taps, plus the bias);
the final Snake is an ``_add_snake``, the k7 conv to one channel + tanh ``_head``. Kernels compute in float32 and
store in the decoder's dtype. The NoiseBlock's noise is drawn with ``torch.randn`` in the same
shapes and order as the module decoder, so with the same seed both add the same noise. On a CPU
the kernels run under ``TRITON_INTERPRET=1`` (the tests do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from .snac import DecoderBlock, NoiseBlock, ResidualUnit, SnacDecoder, Snake

SNAKE_EPS = 1e-9  # snac's: x + sin(alpha x)^2 / (alpha + 1e-9)
BLOCK_T = 32  # time steps a program covers (GPU); the tests also run larger tiles (fewer interpreted programs)


@triton.jit
def _snake(x, alpha, inv):
    s = tl.sin(alpha * x)
    return x + inv * s * s


@triton.jit
def _tile(T, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's (batch row, time steps, channels): axis 0 walks batch x time tiles, axis 1
    channel tiles."""
    n_t = tl.cdiv(T, BLOCK_T)
    b = tl.program_id(0) // n_t
    t = (tl.program_id(0) % n_t) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return b, t, c


@triton.jit
def _add_snake(a_ptr, z_ptr, s_ptr, x_ptr, u_ptr, alpha_ptr, inv_ptr, T, C,
               HAS_Z: tl.constexpr, HAS_S: tl.constexpr, WRITE_X: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """u = snake(x) with x = a + s * z (s per (batch, time); or a + z, or a); x written if asked.
    [B, T, C] tensors."""
    b, t, c = _tile(T, BLOCK_T, BLOCK_C)
    cm = c < C
    tm = t < T
    m = tm[:, None] & cm[None, :]
    off = b.to(tl.int64) * T * C + t[:, None] * C + c[None, :]
    x = tl.load(a_ptr + off, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + off, mask=m, other=0.0).to(tl.float32)
        if HAS_S:
            x += tl.load(s_ptr + b * T + t, mask=tm, other=0.0).to(tl.float32)[:, None] * z
        else:
            x += z
    if WRITE_X:
        tl.store(x_ptr + off, x.to(x_ptr.dtype.element_ty), mask=m)
    aa = tl.load(alpha_ptr + c, mask=cm, other=1.0)[None, :]
    ia = tl.load(inv_ptr + c, mask=cm, other=0.0)[None, :]
    tl.store(u_ptr + off, _snake(x, aa, ia).to(u_ptr.dtype.element_ty), mask=m)


@triton.jit
def _dwconv(u_ptr, y_ptr, w_ptr, bias_ptr, alpha_ptr, inv_ptr, T, C, dilation,
            SNAKE: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """y = snake(dwconv_K(u) + bias) ("same" zero padding, dilated; snake optional); w [K, C]."""
    b, t, c = _tile(T, BLOCK_T, BLOCK_C)
    cm = c < C
    base = b.to(tl.int64) * T * C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(K):
        tt = t + (k - K // 2) * dilation
        m = ((tt >= 0) & (tt < T))[:, None] & cm[None, :]
        u = tl.load(u_ptr + base + tt[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc += u * tl.load(w_ptr + k * C + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    acc += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    if SNAKE:
        aa = tl.load(alpha_ptr + c, mask=cm, other=1.0)[None, :]
        ia = tl.load(inv_ptr + c, mask=cm, other=0.0)[None, :]
        acc = _snake(acc, aa, ia)
    tl.store(y_ptr + base + t[:, None] * C + c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & cm[None, :])


@triton.jit
def _fold(p_ptr, bias_ptr, out_ptr, T_in, T_out, C, pad,
          STRIDE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Transposed conv (kernel 2 * STRIDE) from its per-phase GEMM p [B, T_in, 2 * STRIDE, C]:
    output t sums input q // STRIDE at tap q % STRIDE and input q // STRIDE - 1 at tap
    q % STRIDE + STRIDE (q = t + pad), plus the bias."""
    b, t, c = _tile(T_out, BLOCK_T, BLOCK_C)
    cm = c < C
    tm = t < T_out
    q = t + pad
    hi = q // STRIDE
    k_hi = q - hi * STRIDE
    row = b.to(tl.int64) * T_in
    m_hi = (tm & (hi < T_in))[:, None] & cm[None, :]
    m_lo = (tm & (hi >= 1) & (hi - 1 < T_in))[:, None] & cm[None, :]
    acc = tl.load(p_ptr + ((row + hi[:, None]) * 2 * STRIDE + k_hi[:, None]) * C + c[None, :], mask=m_hi, other=0.0).to(tl.float32)
    acc += tl.load(p_ptr + ((row + hi[:, None] - 1) * 2 * STRIDE + k_hi[:, None] + STRIDE) * C + c[None, :],
                   mask=m_lo, other=0.0).to(tl.float32)
    acc += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + (b.to(tl.int64) * T_out + t[:, None]) * C + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])


@triton.jit
def _head(u_ptr, w_ptr, bias_ptr, out_ptr, T, C, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """out [B, T] = tanh(conv_K(u) to one channel + bias); BLOCK_C >= C."""
    b, t, c = _tile(T, BLOCK_T, BLOCK_C)  # one channel tile: program_id(1) is 0
    cm = c < C
    base = b.to(tl.int64) * T * C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(K):
        tt = t + (k - K // 2)
        m = ((tt >= 0) & (tt < T))[:, None] & cm[None, :]
        u = tl.load(u_ptr + base + tt[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc += u * tl.load(w_ptr + k * C + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1) + tl.load(bias_ptr).to(tl.float32)
    y = 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)  # tanh
    tl.store(out_ptr + b.to(tl.int64) * T + t, y.to(out_ptr.dtype.element_ty), mask=t < T)


def _block_c(c: int) -> int:
    return min(64, triton.next_power_of_2(c))


@dataclass
class _Snake:
    alpha: torch.Tensor  # [C] float32
    inv: torch.Tensor  # [C] float32: 1 / (alpha + 1e-9)

    @classmethod
    def of(cls, m: Snake) -> _Snake:
        a = m.alpha.detach().reshape(-1).float()
        return cls(a.contiguous(), (a + SNAKE_EPS).reciprocal().contiguous())


@dataclass
class _DepthwiseConv:
    w: torch.Tensor  # [K, C]
    bias: torch.Tensor  # [C]
    dilation: int

    @classmethod
    def of(cls, m: nn.Conv1d) -> _DepthwiseConv:
        k = m.kernel_size[0]  # snac.py builds depthwise "same" convs with odd kernels
        assert m.groups == m.in_channels == m.out_channels and k % 2 and m.padding[0] == (k // 2) * m.dilation[0], m
        return cls(m.weight.detach().reshape(m.out_channels, k).t().contiguous(), m.bias.detach().contiguous(), m.dilation[0])


@dataclass
class _Unit:
    snake_a: _Snake
    dw: _DepthwiseConv
    snake_b: _Snake
    w: torch.Tensor  # [C, C] 1x1 conv
    bias: torch.Tensor


@dataclass
class _Block:
    snake: _Snake
    w_phase: torch.Tensor  # [2r * C_out, C_in]: the transposed conv's taps as one GEMM
    bias: torch.Tensor
    stride: int
    pad: int
    output_padding: int
    noise_w: torch.Tensor | None  # [C_out, C_out]
    units: list[_Unit]


def _linear_weight(m: nn.Conv1d) -> torch.Tensor:
    assert m.kernel_size[0] == 1 and m.groups == 1, m
    return m.weight.detach()[:, :, 0].contiguous()


class SnacTritonDecoder:
    """A loaded ``SnacDecoder``'s weights rearranged for the fused channels-last decode. Decodes
    exactly what ``SnacDecoder.decode`` decodes (same noise for the same RNG state)."""

    def __init__(self, model: SnacDecoder, block_t: int | None = None):
        self.block_t = block_t or BLOCK_T
        if not model.config.depthwise:
            raise ValueError("snac_kernels triton needs a depthwise SNAC decoder (config depthwise: true)")
        self.quantizers = model.quantizer.quantizers
        layers = list(model.decoder.model)
        self.start_dw = _DepthwiseConv.of(layers[0])
        self.start_w, self.start_bias = _linear_weight(layers[1]), layers[1].bias.detach()
        self.blocks: list[_Block] = []
        for blk in layers[2:-3]:
            assert isinstance(blk, DecoderBlock)
            snake, convt, *rest = list(blk.block)
            noise = rest.pop(0) if rest and isinstance(rest[0], NoiseBlock) else None
            units = []
            for ru in rest:
                assert isinstance(ru, ResidualUnit)
                sa, dw, sb, pw = list(ru.block)
                units.append(_Unit(_Snake.of(sa), _DepthwiseConv.of(dw), _Snake.of(sb), _linear_weight(pw), pw.bias.detach()))
            w = convt.weight.detach()  # [C_in, C_out, 2r]
            assert convt.kernel_size[0] == 2 * convt.stride[0], convt  # _fold sums exactly two taps
            self.blocks.append(_Block(
                _Snake.of(snake), w.permute(2, 1, 0).reshape(-1, w.shape[0]).contiguous(), convt.bias.detach(),
                convt.stride[0], convt.padding[0], convt.output_padding[0],
                noise.linear.weight.detach()[:, :, 0].contiguous() if noise is not None else None, units))
        head_snake, head_conv, _tanh = layers[-3:]
        self.head_snake = _Snake.of(head_snake)
        self.head_w = head_conv.weight.detach()[0].t().contiguous()  # [K, C]
        self.head_bias = head_conv.bias.detach()
        self.head_k = head_conv.kernel_size[0]

    # -- kernels ----------------------------------------------------------------------------
    def _add_snake(self, a, z, s, snake: _Snake, write_x: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, snake(x)) with x = a + s * z (a + z without s; a without z, then x is a itself)."""
        B, T, C = a.shape
        u = torch.empty_like(a)
        x = torch.empty_like(a) if write_x and z is not None else a
        bc = _block_c(C)
        _add_snake[(B * triton.cdiv(T, self.block_t), triton.cdiv(C, bc))](
            a, z if z is not None else a, s if s is not None else a, x, u, snake.alpha, snake.inv, T, C,
            HAS_Z=z is not None, HAS_S=s is not None, WRITE_X=x is not a, BLOCK_T=self.block_t, BLOCK_C=bc)
        return x, u

    def _dwconv(self, u: torch.Tensor, dw: _DepthwiseConv, snake: _Snake | None) -> torch.Tensor:
        B, T, C = u.shape
        y = torch.empty_like(u)
        bc = _block_c(C)
        _dwconv[(B * triton.cdiv(T, self.block_t), triton.cdiv(C, bc))](
            u, y, dw.w, dw.bias, snake.alpha if snake else dw.w, snake.inv if snake else dw.w, T, C, dw.dilation,
            SNAKE=snake is not None, K=dw.w.shape[0], BLOCK_T=self.block_t, BLOCK_C=bc)
        return y

    def _transposed(self, u: torch.Tensor, blk: _Block) -> torch.Tensor:
        B, T, _ = u.shape
        c_out = blk.bias.shape[0]
        t_out = (T - 1) * blk.stride - 2 * blk.pad + 2 * blk.stride + blk.output_padding
        phases = F.linear(u, blk.w_phase)  # [B, T, 2r * C_out]
        out = torch.empty(B, t_out, c_out, device=u.device, dtype=u.dtype)
        bc = _block_c(c_out)
        _fold[(B * triton.cdiv(t_out, self.block_t), triton.cdiv(c_out, bc))](
            phases, blk.bias, out, T, t_out, c_out, blk.pad, STRIDE=blk.stride, BLOCK_T=self.block_t, BLOCK_C=bc)
        return out

    # -- decode -----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, codes: Sequence[torch.Tensor], *, generator: torch.Generator | None = None,
               noise: bool = True) -> torch.Tensor:
        """codes[i]: integer (B, T_i), already range-checked -> (B, 1, T * upsampling)."""
        z = None
        for q, c in zip(self.quantizers, codes, strict=True):  # codebook -> 1x1 conv -> repeat, summed
            lv = F.linear(q.codebook(c.long()), q.out_proj.weight[:, :, 0], q.out_proj.bias)
            lv = lv.repeat_interleave(q.stride, dim=1)
            z = lv if z is None else z + lv
        # the residual stream x is kept as the lazy sum a + s * z until _add_snake resolves it
        a, zz, s = F.linear(self._dwconv(z, self.start_dw, None), self.start_w, self.start_bias), None, None
        for blk in self.blocks:
            _, u = self._add_snake(a, zz, s, blk.snake, write_x=False)
            a, zz, s = self._transposed(u, blk), None, None
            if blk.noise_w is not None and noise:
                B, T, _ = a.shape  # the module decoder's draw: (B, 1, T) in the activations' dtype
                s = torch.randn((B, 1, T), generator=generator, device=a.device, dtype=a.dtype)
                zz = F.linear(a, blk.noise_w)
            for unit in blk.units:
                a, u = self._add_snake(a, zz, s, unit.snake_a, write_x=True)
                zz, s = F.linear(self._dwconv(u, unit.dw, unit.snake_b), unit.w, unit.bias), None
        _, u = self._add_snake(a, zz, s, self.head_snake, write_x=False)
        B, T, C = u.shape
        out = torch.empty(B, T, device=u.device, dtype=u.dtype)
        _head[(B * triton.cdiv(T, self.block_t),)](u, self.head_w, self.head_bias, out, T, C, K=self.head_k,
                                                   BLOCK_T=self.block_t, BLOCK_C=triton.next_power_of_2(C))
        return out.unsqueeze(1)
