"""The sampler's fast paths as Triton kernels.

Compact path (``sample_compact``, a program per row): when every row of a batch may only draw
from a small allowed set (an audio codebook inside a large text vocabulary: Orpheus' 4,096 SNAC
codes + end-of-speech per code position), the torch sampler gathers those logits and then runs
~30 small kernels (penalty, temperature, sort, softmax, two scans, masks, searchsorted, gathers,
the seen-mask update). At decode batch sizes each is a launch for a few µs of work, and the host
time to issue them sat on the decode step's critical path. One launch does the same work:

1. gather the row's allowed logits (its set's ids, or their columns in a restricted head);
2. repetition penalty from the row's seen-ids mask (HF convention);
3. greedy rows: the first maximum; others: softmax of logits / temperature;
4. top-k / top-p / min-p without sorting: the kept tokens are those whose probability is above
   a threshold t, found by bisection over float32 bit patterns (non-negative floats order as
   their bits). For t between two adjacent probabilities a > b, "the tokens more probable
   than t number < top_k and hold < top_p of the mass" is the sorted definition's "rank <
   top_k and the mass before it < top_p" for b; the smallest such t is the least probable
   kept token's probability, so the kept tokens are those at or above it. The most probable
   token is always kept. min-p drops tokens below min_p x the top probability;
5. an inverse-CDF draw in vocabulary order with the row's uniform u: the drawn token is the
   first whose cumulative kept mass exceeds u x the kept total (as the torch sampler draws);
6. the token id out, and marked in the seen mask (untracked rows write a scratch row).

Full-vocabulary path (``sample_full``, two launches): rows without allowed sets, top-k or
top-p (plain temperature sampling, min-p, repetition penalty, greedy) over the whole
vocabulary. The torch sampler copies the logits to float32, scales, runs softmax, a blocked
float64 scan and a search: ~10 launches over [B, V], ~0.3 ms at 16 x 128k on an H100. Here:

1. a program per (row, block of the vocabulary): penalty, temperature, the block's maximum,
   its sum of exp(z - max) and its first arg-max, to a small stats tensor;
2. a program per row: the row's maximum and total from the block stats (online-softmax
   merge), the block in which the cumulative mass first exceeds u x total, then a scan of
   that block alone for the token. Rows with min-p first sum the kept mass block by block
   (one more pass over their row); greedy rows take the first arg-max.

Same results as the torch path up to float summation order and exp rounding, except among
exactly tied probabilities at a top-p / top-k edge: the sorted path keeps a tie group in part
(in whatever order its sort left the group), the compact kernel keeps the whole group or none
of it; both are valid nucleus samplers. On a CPU the kernels run under ``TRITON_INTERPRET=1``,
which the tests use.

Compiles: Triton builds a kernel on first use per specialization, ~0.5–1.8 s on an H100 during
which every sequence of the engine waits (bench/results/orpheus/trace/). So the row count and
the seen mask's row stride are not specialized on (a new batch size would otherwise compile
again: 1, multiples of 16 and the rest are different specializations), and the first launch
of a shape compiles both repetition-penalty variants, so a request that turns the penalty on
or off later does not stall every stream.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from mstar.services.engines.sampling import FUSED_MAX_WIDTH

log = logging.getLogger(__name__)
#: bisection steps: float32 bit patterns of probabilities lie in [0, 0x3F800000] < 2**30
BISECT_STEPS = 30


@triton.jit
def _sum_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _penalize(x, seen, pen):
    """Repetition penalty, HF convention: a seen token's positive logit / pen, negative x pen."""
    return tl.where(seen != 0, tl.where(x > 0, x / pen, x * pen), x)


@triton.jit(do_not_specialize=["n_rows", "seen_stride"])
def _sample_rows(logits_ptr, logits_stride, ids_ptr, cols_ptr, table_stride, rows_ptr, n_rows,
                 seen_ptr, seen_stride, out_ptr, width,
                 PENALIZE: tl.constexpr, USE_COLS: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    r = tl.program_id(0)
    # per-row numbers, float64 [9, n_rows]: set id, seen slot, penalty, temperature, top_p,
    # min_p, top_k, greedy, uniform
    set_id = tl.load(rows_ptr + r).to(tl.int64)
    j = tl.arange(0, BLOCK)
    inb = j < width
    tok = tl.load(ids_ptr + set_id * table_stride + j, mask=inb, other=-1)
    valid = tok >= 0
    if USE_COLS:
        col = tl.load(cols_ptr + set_id * table_stride + j, mask=inb, other=0)
    else:
        col = tok
    col = tl.where(valid, col, 0)
    x = tl.load(logits_ptr + r.to(tl.int64) * logits_stride + col, mask=valid, other=0.0).to(tl.float32)
    x = tl.where(valid, x, float("-inf"))
    slot = tl.load(rows_ptr + n_rows + r).to(tl.int64)
    if PENALIZE:
        pen = tl.load(rows_ptr + 2 * n_rows + r).to(tl.float32)
        seen = tl.load(seen_ptr + slot * seen_stride + tok, mask=valid, other=0)  # slot 0: never seen
        x = _penalize(x, seen, pen)
    temp = tl.load(rows_ptr + 3 * n_rows + r).to(tl.float32)
    top_p = tl.load(rows_ptr + 4 * n_rows + r).to(tl.float32)
    min_p = tl.load(rows_ptr + 5 * n_rows + r).to(tl.float32)
    top_k = tl.load(rows_ptr + 6 * n_rows + r).to(tl.int32)
    greedy = tl.load(rows_ptr + 7 * n_rows + r)
    u = tl.load(rows_ptr + 8 * n_rows + r).to(tl.float32)

    top = tl.argmax(x, 0)  # the first maximum: the greedy pick, and always kept
    z = x / temp
    e = tl.exp(z - tl.max(z, 0))
    p = e / tl.sum(e, 0)
    p = tl.where(valid, p, 0.0)
    pbits = p.to(tl.int32, bitcast=True)
    pmax = tl.max(p, 0)
    # threshold: the smallest t with (#p > t) < top_k and mass(p > t) < top_p. For t between two
    # adjacent probabilities a > b that is the sorted rule for b (its rank and the mass before
    # it), so the kept tokens are those with p >= t
    # (without top-k / top-p every t passes: t = 0 keeps every token)
    lo = tl.zeros((), tl.int32)
    hi = pmax.to(tl.int32, bitcast=True)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        above = pbits > mid
        cnt, mass = tl.reduce((above.to(tl.float32), tl.where(above, p, 0.0)), 0, _sum_pair)
        ok = ((top_k <= 0) | (cnt < top_k.to(tl.float32))) & ((top_p >= 1.0) | (mass < top_p))
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid + 1)
    kept = ((pbits >= hi) & (p >= min_p * pmax)) | (j == top)
    q = tl.where(kept, p, 0.0)
    # the draw, in vocabulary order (the set's ids ascend): the first token whose cumulative
    # kept mass exceeds u x the kept total
    cs = tl.cumsum(q, 0)
    pick = tl.min(tl.where(cs > u * tl.sum(q, 0), j, BLOCK), 0)
    # rounding can leave no candidate (all kept mass <= target): take the last kept token
    pick = tl.where(pick < BLOCK, pick, tl.max(tl.where(q > 0, j, -1), 0))
    pick = tl.where(greedy != 0, top, pick)
    token = tl.sum(tl.where(j == pick, tok, 0), 0)
    tl.store(out_ptr + r, token)
    if PENALIZE:  # untracked rows write the scratch row 1
        tl.store(seen_ptr + tl.where(slot > 0, slot, 1) * seen_stride + token, 1)


def sample_compact(logits: torch.Tensor, ids: torch.Tensor, cols: torch.Tensor | None, per_row: torch.Tensor,
                   seen: torch.Tensor | None) -> torch.Tensor:
    """Token ids [B] (int64) for logits [B, V'] whose rows draw from allowed sets: ``ids``
    [sets, W] token ids (-1 padding), ``cols`` the same shape with each id's column in the
    logits (None: the id is its column), ``per_row`` the sampler's float64 [9, B] numbers
    (set id, seen slot, penalty, temperature, top_p, min_p, top_k, greedy, uniform), ``seen``
    the [slots, V] bool seen-ids mask when any row is penalised (rows with slot 0 are not)."""
    n, width = logits.shape[0], ids.shape[1]
    if width > FUSED_MAX_WIDTH:
        raise ValueError(f"allowed sets of {width} ids exceed the fused sampler's {FUSED_MAX_WIDTH}")
    if cols is not None and cols.shape != ids.shape:
        raise ValueError(f"cols {tuple(cols.shape)} must match ids {tuple(ids.shape)}")
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    block = max(128, triton.next_power_of_2(width))
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    ids = ids.contiguous()
    per_row = per_row.contiguous()
    cols_arg = cols.contiguous() if cols is not None else ids
    warps = 16 if block >= 8192 else 8 if block >= 2048 else 4

    def launch(grid, penalize: bool, seen_arg: torch.Tensor, seen_stride: int) -> None:
        grid(logits, logits.stride(0), ids, cols_arg, ids.stride(0), per_row, n, seen_arg, seen_stride, out, width,
             PENALIZE=penalize, USE_COLS=cols is not None, BLOCK=block, STEPS=BISECT_STEPS, num_warps=warps)

    _launch_both_variants(_sample_rows, (n,), launch, seen, ids,
                          ("compact", logits.device, logits.dtype, cols is not None, block, width, logits.stride(0)))
    return out


#: the full-vocabulary path's block: a program of the first kernel per BLOCK ids of a row
FULL_BLOCK = 4096


@triton.jit(do_not_specialize=["n_rows", "seen_stride"])
def _full_block_stats(logits_ptr, logits_stride, rows_ptr, n_rows, seen_ptr, seen_stride, stats_ptr, vocab, n_blocks,
                      PENALIZE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    b = tl.program_id(1)
    j = b * BLOCK + tl.arange(0, BLOCK)
    inb = j < vocab
    x = tl.load(logits_ptr + r.to(tl.int64) * logits_stride + j, mask=inb, other=float("-inf")).to(tl.float32)
    if PENALIZE:
        slot = tl.load(rows_ptr + n_rows + r).to(tl.int64)
        pen = tl.load(rows_ptr + 2 * n_rows + r).to(tl.float32)
        seen = tl.load(seen_ptr + slot * seen_stride + j, mask=inb, other=0)  # slot 0: never seen
        x = _penalize(x, seen, pen)
    z = x / tl.load(rows_ptr + 3 * n_rows + r).to(tl.float32)
    m = tl.max(z, 0)
    s = tl.sum(tl.exp(z - tl.where(m > float("-inf"), m, 0.0)), 0)
    out = stats_ptr + (r.to(tl.int64) * n_blocks + b) * 4
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, tl.max(x, 0))
    tl.store(out + 3, tl.argmax(x, 0).to(tl.float32))  # the block's first maximum (< BLOCK: exact)


@triton.jit
def _full_scaled_block(logits_ptr, row_off, rows_ptr, n_rows, r, seen_ptr, seen_row, b, vocab, top_z, min_p,
                       PENALIZE: tl.constexpr, BLOCK: tl.constexpr):
    """exp(z - top_z) of block ``b`` of row ``r``, 0 past the vocabulary and below min-p."""
    j = b * BLOCK + tl.arange(0, BLOCK)
    inb = j < vocab
    x = tl.load(logits_ptr + row_off + j, mask=inb, other=float("-inf")).to(tl.float32)
    if PENALIZE:
        pen = tl.load(rows_ptr + 2 * n_rows + r).to(tl.float32)
        seen = tl.load(seen_row + j, mask=inb, other=0)
        x = _penalize(x, seen, pen)
    e = tl.exp(x / tl.load(rows_ptr + 3 * n_rows + r).to(tl.float32) - top_z)
    return tl.where(inb & (e >= min_p), e, 0.0)  # p >= min_p x p_max  <=>  exp(z - max z) >= min_p


@triton.jit(do_not_specialize=["n_rows", "seen_stride"])
def _full_pick(logits_ptr, logits_stride, rows_ptr, n_rows, seen_ptr, seen_stride, stats_ptr, out_ptr, vocab,
               n_blocks, PENALIZE: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr):
    r = tl.program_id(0)
    k = tl.arange(0, NB)
    kin = k < n_blocks
    st = stats_ptr + (r.to(tl.int64) * n_blocks + k) * 4
    m = tl.load(st, mask=kin, other=float("-inf"))
    top_z = tl.max(m, 0)
    mass = tl.where(m > float("-inf"), tl.load(st + 1, mask=kin, other=0.0) * tl.exp(m - top_z), 0.0)
    xmax = tl.load(st + 2, mask=kin, other=float("-inf"))
    best = tl.argmax(xmax, 0)  # the first block holding the row's maximum, then its first arg-max
    top = best * BLOCK + tl.sum(tl.where(k == best, tl.load(st + 3, mask=kin, other=0.0), 0.0), 0).to(tl.int32)
    slot = tl.load(rows_ptr + n_rows + r).to(tl.int64)
    seen_row = seen_ptr + slot * seen_stride
    row_off = r.to(tl.int64) * logits_stride
    min_p = tl.load(rows_ptr + 5 * n_rows + r).to(tl.float32)
    greedy = tl.load(rows_ptr + 7 * n_rows + r)
    u = tl.load(rows_ptr + 8 * n_rows + r).to(tl.float32)
    if min_p > 0:  # the kept mass per block needs the row's maximum: one more pass over the row
        mass = tl.zeros([NB], tl.float32)
        for b in range(0, n_blocks):
            kept = tl.sum(_full_scaled_block(logits_ptr, row_off, rows_ptr, n_rows, r, seen_ptr, seen_row, b, vocab,
                                             top_z, min_p, PENALIZE, BLOCK), 0)
            mass = tl.where(k == b, kept, mass)
    target = u * tl.sum(mass, 0)
    cum = tl.cumsum(mass, 0)
    hit = tl.min(tl.where(kin & (cum > target), k, n_blocks), 0)
    before = tl.sum(tl.where(k < hit, mass, 0.0), 0)
    last = tl.max(tl.where(mass > 0, k, 0), 0)
    # rounding can leave no block past the target: the last block with kept mass, its last token
    blk = tl.where(hit < n_blocks, hit, last)
    q = _full_scaled_block(logits_ptr, row_off, rows_ptr, n_rows, r, seen_ptr, seen_row, blk, vocab, top_z, min_p,
                           PENALIZE, BLOCK)
    i = tl.arange(0, BLOCK)
    cs = before + tl.cumsum(q, 0)
    pick = tl.min(tl.where(cs > target, i, BLOCK), 0)
    pick = tl.where(pick < BLOCK, pick, tl.max(tl.where(q > 0, i, 0), 0))
    token = tl.where(greedy != 0, top, blk * BLOCK + pick).to(tl.int64)
    tl.store(out_ptr + r, token)
    if PENALIZE:  # untracked rows write the scratch row 1
        tl.store(seen_ptr + tl.where(slot > 0, slot, 1) * seen_stride + token, 1)


def sample_full(logits: torch.Tensor, per_row: torch.Tensor, seen: torch.Tensor | None,
                block: int | None = None) -> torch.Tensor:
    """Token ids [B] (int64) for full-vocabulary logits [B, V] whose rows use neither allowed
    sets nor top-k / top-p: ``per_row`` and ``seen`` as for ``sample_compact`` (set id, top_p
    and top_k are not read). ``block``: ids per program of the first kernel (a power of two;
    default ``FULL_BLOCK``)."""
    n, vocab = logits.shape
    block = FULL_BLOCK if block is None else block
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    per_row = per_row.contiguous()
    n_blocks = -(-vocab // block)
    stats = torch.empty((n, n_blocks, 4), dtype=torch.float32, device=logits.device)
    warps = 8 if block >= 2048 else 4
    nb = max(16, triton.next_power_of_2(n_blocks))

    def stats_launch(grid, penalize: bool, seen_arg: torch.Tensor, seen_stride: int) -> None:
        grid(logits, logits.stride(0), per_row, n, seen_arg, seen_stride, stats, vocab, n_blocks, PENALIZE=penalize,
             BLOCK=block, num_warps=warps)

    def pick_launch(grid, penalize: bool, seen_arg: torch.Tensor, seen_stride: int) -> None:
        grid(logits, logits.stride(0), per_row, n, seen_arg, seen_stride, stats, out, vocab, n_blocks,
             PENALIZE=penalize, BLOCK=block, NB=nb, num_warps=warps)

    key = ("full", logits.device, logits.dtype, block, vocab, logits.stride(0))
    _launch_both_variants(_full_block_stats, (n, n_blocks), stats_launch, seen, per_row, key)
    _launch_both_variants(_full_pick, (n,), pick_launch, seen, per_row, key)
    return out


#: (kernel, shape key) whose both penalty variants are compiled
_COMPILED: set[tuple] = set()


def _launch_both_variants(kernel, grid: tuple[int, ...], launch, seen: torch.Tensor | None, dummy: torch.Tensor,
                          key: tuple) -> None:
    """Launch ``kernel`` on ``grid`` for this call's penalty variant (``launch(grid_fn, penalize,
    seen, seen_stride)``); on CUDA, the first call for ``key`` also compiles the other variant
    without running it (``warmup``). ``dummy``: any device tensor for unused seen arguments."""
    if dummy.device.type == "cuda" and (kernel, key) not in _COMPILED:
        _COMPILED.add((kernel, key))
        other = seen is None  # the variant this call does not launch
        try:
            launch(lambda *a, **k: kernel.warmup(*a, grid=(1,), **k), other,
                   torch.empty(1, dtype=torch.uint8, device=dummy.device) if other else dummy, 1 if other else 0)
        except Exception:  # a pre-compile only: the step goes on; the variant compiles when first used
            log.warning("could not pre-compile %s's penalty=%s variant", kernel.fn.__name__, other, exc_info=True)
    launch(kernel[grid], seen is not None, seen.view(torch.uint8) if seen is not None else dummy,
           seen.stride(0) if seen is not None else 0)  # the seen-mask arguments are unused unless penalised
