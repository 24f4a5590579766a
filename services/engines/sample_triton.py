"""The sampler's compact path as one Triton kernel: a program per row.

When every row of a batch may only draw from a small allowed set (an audio codebook inside a
large text vocabulary: Orpheus' 4,096 SNAC codes + end-of-speech per code position), the torch
sampler gathers those logits and then runs ~30 small kernels (penalty, temperature, sort,
softmax, two scans, masks, searchsorted, gathers, the seen-mask update). At decode batch sizes
each is a launch for a few µs of work, and the host time to issue them sat on the decode
step's critical path. This kernel does the same work in one launch:

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
5. an inverse-CDF draw in descending-probability order with the row's uniform u: the drawn
   token is the one at which the cumulative kept mass first exceeds u x the kept total, found
   by a second bisection (the kept mass above a threshold); tokens of equal probability take
   their turns in vocabulary order;
6. the token id out, and marked in the seen mask (untracked rows write a scratch row).

Same results as the torch path up to float summation order, except among exactly tied
probabilities: the sorted path keeps a tie group at the top-p / top-k edge in part (in whatever
order its sort left the group), this one keeps the whole group or none of it; both are valid
nucleus samplers. On a CPU it runs under ``TRITON_INTERPRET=1``, which the tests use.

Compiles: Triton builds the kernel on first use per specialization, ~0.5–1.8 s on an H100
during which every sequence of the engine waits (bench/results/orpheus/trace/). So the row
count and the seen mask's row stride are not specialized on (a new batch size would
otherwise compile again: 1, multiples of 16 and the rest are different specializations),
and the first launch of an allowed-set width compiles both repetition-penalty variants, so a
request that turns the penalty on or off later does not stall every stream.
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
        x = tl.where(seen != 0, tl.where(x > 0, x / pen, x * pen), x)
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
    qbits = q.to(tl.int32, bitcast=True)
    target = u * tl.sum(q, 0)
    # the draw: the smallest t with mass(q > t) <= target; the token is the largest q <= t
    lo = tl.zeros((), tl.int32)
    hi = tl.max(q, 0).to(tl.int32, bitcast=True)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        ok = tl.sum(tl.where(qbits > mid, q, 0.0), 0) <= target
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid + 1)
    # tokens tied at that probability share its mass in vocabulary order: the target's offset
    # into the group's mass names the member
    qt = hi.to(tl.float32, bitcast=True)
    tied = (q > 0) & (qbits == hi)
    n_tied = tl.sum(tied.to(tl.int32), 0)
    member = ((target - tl.sum(tl.where(qbits > hi, q, 0.0), 0)) / qt).to(tl.int32)
    member = tl.minimum(tl.maximum(member, 0), n_tied - 1)
    pick = tl.argmax((tied & (tl.cumsum(tied.to(tl.int32), 0) == member + 1)).to(tl.int32), 0)
    # rounding can leave no candidate (all kept mass <= target): take the least likely kept token
    last = tl.argmin(tl.where(q > 0, q, float("inf")), 0)
    pick = tl.where(n_tied > 0, pick, last)
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

    def launch(kernel, penalize: bool, seen_arg: torch.Tensor, seen_stride: int) -> None:
        kernel(logits, logits.stride(0), ids, cols_arg, ids.stride(0), per_row, n, seen_arg, seen_stride, out, width,
               PENALIZE=penalize, USE_COLS=cols is not None, BLOCK=block, STEPS=BISECT_STEPS, num_warps=warps)

    key = (logits.device, logits.dtype, cols is not None, block, width, logits.stride(0))
    if logits.device.type == "cuda" and key not in _COMPILED:
        _COMPILED.add(key)
        other = seen is None  # the variant this call does not launch: compile it now, run nothing
        try:
            launch(lambda *a, **k: _sample_rows.warmup(*a, grid=(1,), **k), other,
                   torch.empty(1, dtype=torch.uint8, device=logits.device) if other else ids, 1 if other else 0)
        except Exception:  # a pre-compile only: the step itself goes on; the variant compiles when first used
            log.warning("could not pre-compile the fused sampler's penalty=%s variant", other, exc_info=True)
    launch(_sample_rows[(n,)], seen is not None, seen.view(torch.uint8) if seen is not None else ids,
           seen.stride(0) if seen is not None else 0)  # the seen-mask arguments are unused unless penalised
    return out


#: (device, dtype, restricted head, block, width, logits row stride) whose both penalty variants are compiled
_COMPILED: set[tuple] = set()
