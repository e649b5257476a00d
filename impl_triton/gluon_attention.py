"""The Hopper (sm_90) forward in Gluon: a kernel that owns its schedule.

``triton.language`` leaves the schedule to the compiler (benchmarks/NOTES.md: everything it offers
toward cuDNN's was built and measured); Gluon, Triton's lower-level DSL, exposes what FlashAttention-3
is built from: explicit layouts, TMA copies completing on mbarriers, and asynchronous warp-group MMAs.

Three kernels share the consumer warps' loop (``_consume``): Q is copied once by TMA, K and V tiles
stream through a ring of ``STAGES`` shared-memory slots, S = Q K^T and O += P V run as asynchronous
``warpgroup_mma`` with P passed in registers, the softmax of tile j overlapping S of tile j + 1
(FlashAttention-3's in-warp-group overlap), the online softmax is the ``tl`` kernel's (names
``acc``, ``m_i``, ``l_i``, ``qk``, ``p``), and the output leaves by TMA through Q's shared tile.
``_gluon_attn_fwd``'s warps refill the ring themselves; ``_gluon_attn_fwd_ws`` gives that to a producer
warp of its own (``warp_specialize``); ``_gluon_attn_fwd_pp`` adds FlashAttention-3's consumer warp
groups taking turns, two in ping-pong or three in a ring (one's softmax under the others' products).

It serves the plain forward only: float16 or bfloat16, D = Dv in {64, 128, 256}, causal (either
alignment) or not, any scale, grouped-query heads, an optional log-sum-exp; inputs and output whose
strides TMA takes (unit last stride, 16-byte aligned rows and base). Everything else stays on the ``tl``
kernel (``serves``); of what it serves, the Triton backend sends it the head dims and lengths where it is
faster (``variant``: the config table's gluon section; ``ATTENTION_GLUON=1`` every plan it serves, ``0``
none). The ping-pong variants (in persistent programs too) also take FP8 inputs (``forward(..., pingpong=True,
descales=...)``: e4m3 q, k and v at D 64 and 128, the values column-major, in the P·V order where the plan
copied them so: ``_p_operand``); the config table sends FP8 plans to them where they timed faster than the
tl kernel's FP8 forward (at D 128; benchmarks/NOTES.md).
"""

from __future__ import annotations

import copy
import functools
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from common import compat
from common.launch import COMPILE_OPTIONS, alignment, launch_compiled
from common.plan import MAX_GRID_AXIS, PV_GROUP, Widen, pv_order_fits

# (triton 3.6 names the TMA copy async_copy_global_to_shared; later versions async_load)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)

HEAD_DIMS = (64, 128, 256)
# The head dims whose 16-bit key loop is split in two (``_consume``): the tiles every row sees whole, then the masked
# ones, so that the whole tiles' loop carries no mask code. Where it timed faster (benchmarks/NOTES.md): D 128 and 256
# under triton >= 3.9, whose single loop spills there; under 3.6 it timed even and spilled more, and at D 64 slower.
SPLIT_KEY_LOOP_DIMS = (128, 256) if compat.triton_version() >= (3, 9) else ()
FP8_HEAD_DIMS = (64, 128)  # (the ping-pong variant's FP8 inputs)
PRODUCER_REGS = 24  # the producer warp's registers (it holds no tile)
# The head dims where a quarter of each tile's exponentials are computed on the FMA units (``_exp2_fma``) instead of
# the special-function unit, FlashAttention-4's remedy where that unit binds: on sm_90 it gives 16 results a clock an
# SM against 128 for the FMA units, so that at D 64 a tile's exponentials take as long as its two products. Where it
# timed faster (benchmarks/NOTES.md): D 64 without a causal mask, 16-bit, under triton >= 3.9 (``_fma_quarter``);
# slower under 3.6, at D 64 causal and at D 128 and 256.
EXP2_FMA_DIMS = (64, ) if compat.triton_version() >= (3, 9) else ()
# 2^f on [-1/2, 1/2] (f = x - round(x)): 1 + f (C1 + f (C2 + f C3)), C* fitted to its relative error, at most
# 1.02e-4 (2^-13.3) from 2^f in float32; P is then rounded to 16 (or 8) bits, whose half-ulp is 2^-12 or more
EXP2_C1 = gl.constexpr(0.6932829022407532)
EXP2_C2 = gl.constexpr(0.24221037328243256)
EXP2_C3 = gl.constexpr(0.05500858277082443)


@gluon.jit
def _exp2_fma(x):
    """2^x for x <= 0 (or -inf) without the special-function unit: x clamped at -127 (whose result is exactly 0,
    as 2^-inf's), rounded to an integer n in the low bits of x + 1.5 * 2^23, the fraction's polynomial (EXP2_C*, 1
    at 0 exactly) times 2^n by adding n to the result's exponent field (n << 23 is what the shifted sum leaves
    modulo 2^32)."""
    x = gl.maximum(x, -127.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    r = (EXP2_C3 * f + EXP2_C2) * f + EXP2_C1
    r = r * f + 1.0
    return (r.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)).to(gl.float32, bitcast=True)


@gluon.jit
def _exp2(x, FMA_QUARTER: gl.constexpr):
    """2^x over S's tile (x <= 0): FMA_QUARTER, a quarter of it by ``_exp2_fma`` and the rest on the
    special-function unit, which elements go where decided by the bits of a thread's register index (the
    pairs' second columns, then their top halves), so that splitting and joining move no data; else all there."""
    if not FMA_QUARTER:
        p = gl.exp2(x)
    else:
        M: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        a, b = x.reshape([M, N // 2, 2]).split()
        b1, b2 = b.reshape([M, 2, N // 4]).permute((0, 2, 1)).split()
        p2 = _exp2_fma(b2)  # (first: the FMA units' share issued ahead of the special-function unit's)
        pb = gl.join(gl.exp2(b1), p2).permute((0, 2, 1)).reshape([M, N // 2])
        pb = gl.convert_layout(pb, a.type.layout)
        p = gl.convert_layout(gl.join(gl.exp2(a), pb).reshape([M, N]), x.type.layout)
    return p


@gluon.jit
def _softmax_step(qk, m_i, l_i, offs_m, j, whole, Lk, qk_scale, causal_shift, BLOCK_N: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, NEGATIVE_SCALE: gl.constexpr, col_layout: gl.constexpr,
                  dtype: gl.constexpr, HEAD_DIM: gl.constexpr, MASKED: gl.constexpr = None):
    """Key tile j's online-softmax update (base 2): the new row maxima, P, the rescale factor of what
    came before, the new row sums. P is rounded to P V's operand type (``dtype``, the inputs') here, once its
    row sums are taken in float32: the loop then carries it in half the registers (a thread's P of 128 keys in
    32 registers, not 64), which keeps the key loop's values out of the stack. FP8's P stays float32 here:
    rounded to e4m3 before the P·V order's reshape, its bytes would need permutes to pack four to a register,
    so ``_p_operand`` rounds it after. Past the first ``whole`` tiles (``_whole_tiles``) the raw scores are
    masked (keys past Lk; causal); the tiles before need no mask. MASKED (a caller's loop over tiles known to
    be on one side of ``whole``): True or False decides it at compile time, so that a
    loop of whole tiles carries no mask code; None tests j. The scores are
    scaled and their maximum subtracted in one FMA each, as in the tl kernel: the maximum of
    qk * qk_scale is max(qk) * qk_scale, or min(qk) * qk_scale for a NEGATIVE_SCALE (whose masked
    scores are +inf, so that scaled they are -inf). (FP8 inputs' descales, whose sign no constant
    knows, come here positive: ``_consume`` moves a negative scale onto Q.) A quarter of the exponentials run
    on the FMA units where ``_fma_quarter`` says."""
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    if MASKED is None:
        masked = j >= whole
    else:
        masked = MASKED
    if masked:
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        valid = offs_n[None, :] < Lk
        if IS_CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
        qk = gl.where(valid, qk, float("inf") if NEGATIVE_SCALE else float("-inf"))
    if NEGATIVE_SCALE:
        m_ij = gl.maximum(m_i, gl.min(qk, 1) * qk_scale)
    else:
        m_ij = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    m_sub = m_ij
    if masked:
        m_sub = gl.where(m_ij == float("-inf"), 0.0, m_ij)  # a row with no key yet: p = 0, not NaN
    p = _exp2(qk * qk_scale - m_sub[:, None], _fma_quarter(HEAD_DIM, FP8, IS_CAUSAL))
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p.to(gl.float32 if FP8 else dtype), m_ij, l_i, alpha


@gluon.jit
def _whole_tiles(Lk, row_start, causal_shift, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """How many leading key tiles every row from ``row_start`` sees whole (no key past Lk; causal:
    the tile's last key at or before the first row's position), which need no mask."""
    whole = Lk // BLOCK_N
    if IS_CAUSAL:
        whole = gl.minimum(whole, gl.maximum(row_start + causal_shift + 1, 0) // BLOCK_N)
    return whole


@gluon.jit
def _barriers(N: gl.constexpr, arrivals: gl.constexpr):
    """N mbarriers in shared memory ([N, 1]), each completing a phase after ``arrivals`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N):
        mbarrier.init(bars.index(i), count=arrivals)
    return bars


@gluon.jit
def _invalidate(bars, N: gl.constexpr):
    """``_barriers``' N mbarriers invalidated (the kernel's end: their shared memory may be reused)."""
    for i in gl.static_range(N):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _gluon_attn_fwd(
    q_desc, k_desc, v_desc, o_desc, Lse,
    scale, H, GROUP, Lq, Lk, causal_shift,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, WITH_LSE: gl.constexpr, NEGATIVE_SCALE: gl.constexpr, num_warps: gl.constexpr,
):
    """One (batch, head, BLOCK_M-row block) program. Descriptors over (B, H, L, D) tensors, blocks
    (1, 1, rows, D): rows past a head's length read as zeros (TMA's bounds are the tensor's), and
    keys past Lk are masked. Causal: row i sees keys j <= i + causal_shift (0: top-left; Lk - Lq:
    bottom-right). o_desc is the output's descriptor, blocks as q_desc's; Lse (B, H, Lq) float32. Its warps
    fill the K/V ring themselves (``_consume`` with PRODUCER False)."""
    dtype: gl.constexpr = q_desc.dtype
    start_m, off_hz, off_z, off_h, off_h_kv = _program(H, GROUP)
    q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bars = _barriers(1, 1)
    kv_bars = _barriers(2 * STAGES, 1)
    fence_async_shared()
    q_bar = q_bars.index(0)
    n_tiles = _key_tiles(Lk, start_m, causal_shift, BLOCK_M, BLOCK_N, IS_CAUSAL)
    _consume(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_bars, kv_bars, q_bar, q_bar, o_desc, q_smem,
             Lse, scale, 1.0, 1.0, Lq, Lk, causal_shift, off_z, off_h, off_h_kv, off_hz,
             start_m * BLOCK_M, n_tiles, 0, 0, True, (-1, 0, 1), BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL,
             WITH_LSE, False, False, 0, NEGATIVE_SCALE, False, False)
    _invalidate(q_bars, 1)
    _invalidate(kv_bars, 2 * STAGES)


@gluon.jit
def _program(H, GROUP):
    """This program's (row block, batch·head, batch, head, K/V head): the grid is (row blocks, B·H),
    and head h reads K/V head h // GROUP. A head's row blocks run last first: causal, the last rows
    reach the most keys, and the longest programs started first leave the shortest for the tail (as
    the tl kernel orders them)."""
    start_m = gl.num_programs(0) - 1 - gl.program_id(0)
    off_hz = gl.program_id(1)
    off_h = off_hz % H
    return start_m, off_hz, off_hz // H, off_h, off_h // GROUP


@gluon.jit
def _key_tiles(Lk, start_m, causal_shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """How many key tiles a row block reaches (causal: up to its last row's last key)."""
    hi = Lk
    if IS_CAUSAL:
        hi = gl.minimum(Lk, gl.maximum((start_m + 1) * BLOCK_M + causal_shift, 0))
    return gl.cdiv(hi, BLOCK_N)


@gluon.jit
def _consume(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn_wait, turn_arrive,
             o_desc, o_smem, Lse, scale, qk_descale, v_descale, Lq, Lk, causal_shift, off_z, off_h, off_h_kv, off_hz,
             row_start, n_tiles, base, q_phase, load_q, next_q, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, WITH_LSE: gl.constexpr,
             PRODUCER: gl.constexpr, PINGPONG: gl.constexpr, TURN_FIRST: gl.constexpr, NEGATIVE_SCALE: gl.constexpr,
             PREFETCH_Q: gl.constexpr, PV_ORDER: gl.constexpr):
    """The consumer warps' work, every kernel's: Q by TMA (its ``q_bar`` completing phase ``q_phase``), the
    online softmax over ``n_tiles`` tiles of the K/V ring (the ring's tile t in slot t % STAGES; this row
    block's first is the ring's tile ``base``: a persistent program's ring runs on across its row blocks),
    the output and log-sum-exp stored. With 16-bit inputs a slot's K and V have barriers of their own
    (FlashAttention-3's two pipelines): K's ``kv_ready[slot]`` and ``kv_empty[slot]``, V's
    ``kv_ready[STAGES + slot]`` and ``kv_empty[STAGES + slot]``; FP8 tiles share K's. PRODUCER: a producer
    warp fills the ring (``_ws_producer``); a slot's K goes back to it as soon as S of its tile is in, its
    V once P V is (FP8: both then), so that a slot's next keys load under the tile's softmax and P V
    instead of after them (a slot released whole leaves a ring of two stages about one tile ahead).
    Otherwise these warps fill the ring themselves, the next tile of a slot issued into it as soon as its
    tile has been read by both products.

    FlashAttention-3's overlap inside a warp group: while the tensor cores run S of tile j and
    P V of tile j - 1, the warps compute tile j's softmax as soon as its S is back (S_j issued
    first, so waiting for all but the newest group returns it); O is rescaled once P V of tile
    j - 1 is in, before P V of tile j is issued.

    The consumer owns BLOCK_M rows from ``row_start``. PINGPONG (FlashAttention-3's consumer warp
    groups taking turns, ``_gluon_attn_fwd_pp``): each round's products (S of tile j, P V of tile j - 1)
    are issued only once the consumer before it issued its own (``turn_wait``; this one's
    ``turn_arrive`` lets the next go), so one warp group's softmax runs under the others' products;
    TURN_FIRST: 1 for the consumer that goes first (its first wait passes on a fresh barrier's phase).
    All consumers run the same ``n_tiles`` rounds, or the turns would wait for ever. The tiles every row
    sees whole skip the mask (``_softmax_step``; NEGATIVE_SCALE: the scale's sign).

    FP8 (float8_e4m3fn q, k, v: ``q_desc.dtype``): the scores' scale takes ``qk_descale`` (the query's
    and keys' descales), the output ``v_descale``; P is rounded to e4m3 for P V (FlashAttention-3's
    choice, the tl kernel's default), whose B operand must be K-major: the values come column-major, their
    tiles (D, BLOCK_N) (``_v_operand``). The output, 16-bit, is staged in ``o_smem`` (Q's own tile where
    the dtypes agree). PV_ORDER: the values' keys are in the P·V order (``common.plan.PV_GROUP``), and so
    are P's columns (``_p_operand``): a reshape that leaves every thread's registers in place, where P in
    key order reaches the 8-bit operand's layout only through shuffles between threads.

    PREFETCH_Q (a persistent program whose output has a shared tile of its own): Q of the consumer's next
    row block (``next_q``: (rows from, batch·head, heads), rows from -1 where there is none) is loaded into Q's
    tile as soon as this block's last S is in, under its last softmax, P V and epilogue; a row block loads
    its own Q only where ``load_q`` (a program's first), and the output's bulk copy is waited for only
    before the tile is written again."""
    num_warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = q_desc.dtype
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    SPLIT: gl.constexpr = _split_kv(dtype)
    # S's and O's register layouts (the accumulators of warp-group MMAs: 16-row atoms over the
    # warps, n the tile's width, k 32 bytes), P as O's A operand in registers (32 bits a register)
    K_INSTR: gl.constexpr = 32 if FP8 else 16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, K_INSTR])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, K_INSTR])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    if PREFETCH_Q:
        if load_q:
            _load_q(q_desc, q_bar, q_smem, row_start, off_z, off_h)
    else:
        _load_q(q_desc, q_bar, q_smem, row_start, off_z, off_h)
    if not PRODUCER:
        for s in gl.static_range(STAGES):  # the ring's first tiles in flight
            if s < n_tiles:
                _load_kv(k_desc, v_desc, k_smem, v_smem, kv_ready, s, s * BLOCK_N, off_z, off_h_kv, STAGES)

    qk_scale = scale * LOG2E * qk_descale
    whole = _whole_tiles(Lk, row_start, causal_shift, BLOCK_N, IS_CAUSAL)
    offs_m = row_start + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, q_phase)
    q = q_smem.reshape([BLOCK_M, HEAD_DIM])
    if FP8:
        # A descale's sign is the GPU's: a negative scale is moved onto Q (its signs flipped in shared
        # memory once, exact), so that every tile takes its maximum from the raw products and scales a
        # score in one FMA (the 16-bit kernel's step), whatever the descales' signs.
        if qk_scale < 0:
            q_regs: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
            bits = q.load(q_regs).to(gl.uint8, bitcast=True)
            q.store((bits ^ 0x80).to(dtype, bitcast=True))
            fence_async_shared()
            qk_scale = -qk_scale
    if n_tiles > 0:
        first = base % STAGES
        mbarrier.wait(kv_ready.index(first), (base // STAGES) & 1)  # (K of the first tile)
        if PINGPONG:
            # (a round a ring tile: the very first consumer's first wait passes at once)
            mbarrier.wait(turn_wait, (base + TURN_FIRST) & 1)
        qk = warpgroup_mma(q, k_smem.index(first).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                           use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_arrive, count=1)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
        if PRODUCER and SPLIT:
            mbarrier.arrive(kv_empty.index(first), count=1)  # (its K read: the slot's K may be refilled)
        if PREFETCH_Q:
            if n_tiles == 1:  # (Q read for the last time)
                _prefetch_q(q_desc, q_bar, q_smem, next_q)
        p, m_i, l_i, alpha = _softmax_step(qk, m_i, l_i, offs_m, 0, whole, Lk, qk_scale, causal_shift, BLOCK_N,
                                           IS_CAUSAL, NEGATIVE_SCALE, col_s, dtype, HEAD_DIM)
        # (the tiles after the first in one loop, each tile's mask decided by its index; or, _split_key_loop, in two:
        # the tiles every row sees whole, whose loop carries no mask code and so none of its registers, then the rest)
        SPLIT_LOOP: gl.constexpr = _split_key_loop(HEAD_DIM, FP8)
        split = gl.minimum(gl.maximum(whole, 1), n_tiles)
        for part in gl.static_range(2 if SPLIT_LOOP else 1):
            for j in range(split if part == 1 else 1, split if SPLIT_LOOP and part == 0 else n_tiles):
                p, m_i, l_i, acc = _kv_round(j, p, m_i, l_i, acc, q, zero_s, k_smem, v_smem, kv_ready, kv_empty,
                                             turn_wait, turn_arrive, q_desc, q_bar, q_smem, next_q, k_desc, v_desc,
                                             off_z, off_h_kv, base, n_tiles, offs_m, whole, Lk, qk_scale, causal_shift,
                                             BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL, PRODUCER, PINGPONG, TURN_FIRST,
                                             NEGATIVE_SCALE, PREFETCH_Q, PV_ORDER, p_layout, col_s, row_o,
                                             (part == 1) if SPLIT_LOOP else None)
        last = (base + n_tiles - 1) % STAGES
        if SPLIT:  # (V of the last tile)
            mbarrier.wait(kv_ready.index(STAGES + last), ((base + n_tiles - 1) // STAGES) & 1)
        acc = warpgroup_mma(_p_operand(p, dtype, p_layout, PV_ORDER),
                            _v_operand(v_smem.index(last), BLOCK_N, HEAD_DIM, FP8), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if PRODUCER:  # (the last tile's slot too: a persistent program's next row block refills it)
            mbarrier.arrive(kv_empty.index(_v_bar(last, STAGES, SPLIT)), count=1)
    elif PREFETCH_Q:  # (a row block that sees no key never reads Q)
        _prefetch_q(q_desc, q_bar, q_smem, next_q)

    if WITH_LSE:  # -inf for a row with no key (m_i = -inf, l_i = 0)
        lse = (m_i + gl.log2(l_i)) * LN2
        gl.store(Lse + off_hz.to(gl.int64) * Lq + offs_m, lse, mask=offs_m < Lq)
    l_i = gl.where(l_i == 0.0, 1.0, l_i)
    out = acc * gl.convert_layout(v_descale / l_i, row_o)[:, None]
    # The output leaves by TMA through Q's shared tile (same block and layout; every product that read Q
    # is complete; FP8: a 16-bit tile of its own): one bulk copy, clipped at the head's Lq rows by the
    # descriptor, as FlashAttention-3's epilogue, instead of a masked store from each thread.
    if PREFETCH_Q:  # (the previous row block's output has left the tile; the program waits for its last)
        tma.store_wait(0)
    o_smem.reshape([BLOCK_M, HEAD_DIM]).store(out.to(o_desc.dtype))
    fence_async_shared()
    _tma_store(o_desc, [off_z, off_h, row_start, 0], o_smem)
    if not PREFETCH_Q:
        tma.store_wait(0)


@gluon.jit
def _kv_round(j, p, m_i, l_i, acc, q, zero_s, k_smem, v_smem, kv_ready, kv_empty, turn_wait, turn_arrive, q_desc, q_bar,
              q_smem, next_q, k_desc, v_desc, off_z, off_h_kv, base, n_tiles, offs_m, whole, Lk, qk_scale,
              causal_shift, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              IS_CAUSAL: gl.constexpr, PRODUCER: gl.constexpr, PINGPONG: gl.constexpr, TURN_FIRST: gl.constexpr,
              NEGATIVE_SCALE: gl.constexpr, PREFETCH_Q: gl.constexpr, PV_ORDER: gl.constexpr,
              p_layout: gl.constexpr, col_s: gl.constexpr, row_o: gl.constexpr, MASKED: gl.constexpr):
    """``_consume``'s round j >= 1 (its loop's body): S of tile j issued, then P V of tile j - 1; tile j's softmax
    as soon as S is in, under P V (MASKED, ``_softmax_step``'s: True or False where the caller's loop knows which
    side of ``whole`` its tiles are, None to test j); O rescaled once P V is in; the ring's slots handed back or
    refilled. Returns (p, m_i, l_i, acc) after it."""
    dtype: gl.constexpr = q_desc.dtype
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    SPLIT: gl.constexpr = _split_kv(dtype)
    slot = (base + j) % STAGES
    prev = (base + j - 1) % STAGES
    mbarrier.wait(kv_ready.index(slot), ((base + j) // STAGES) & 1)  # (K of tile j)
    if PINGPONG:
        mbarrier.wait(turn_wait, (base + j + TURN_FIRST) & 1)
    qk = warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                       use_acc=False, is_async=True)
    if SPLIT:  # (V of tile j - 1, copied before K of tile j: in place by now)
        mbarrier.wait(kv_ready.index(STAGES + prev), ((base + j - 1) // STAGES) & 1)
    acc = warpgroup_mma(_p_operand(p, dtype, p_layout, PV_ORDER),
                        _v_operand(v_smem.index(prev), BLOCK_N, HEAD_DIM, FP8), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_arrive, count=1)
    qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))
    if PRODUCER and SPLIT:
        mbarrier.arrive(kv_empty.index(slot), count=1)  # (tile j's K read)
    if PREFETCH_Q:
        if j == n_tiles - 1:  # (Q read for the last time)
            _prefetch_q(q_desc, q_bar, q_smem, next_q)
    p, m_i, l_i, alpha = _softmax_step(qk, m_i, l_i, offs_m, j, whole, Lk, qk_scale, causal_shift, BLOCK_N,
                                       IS_CAUSAL, NEGATIVE_SCALE, col_s, dtype, HEAD_DIM, MASKED)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    if PRODUCER:
        mbarrier.arrive(kv_empty.index(_v_bar(prev, STAGES, SPLIT)), count=1)  # (tile j - 1's V read)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    refill = j - 1 + STAGES
    if not PRODUCER and refill < n_tiles:  # (tile j - 1's slot, read by both products)
        _load_kv(k_desc, v_desc, k_smem, v_smem, kv_ready, prev, refill * BLOCK_N, off_z, off_h_kv, STAGES)
    return p, m_i, l_i, acc


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, PV_ORDER: gl.constexpr):
    """P (BLOCK_M, BLOCK_N, S's layout) as P V's A operand in registers: rounded to ``dtype`` (16-bit P comes
    rounded already: ``_softmax_step``) and, PV_ORDER, its columns in the P·V order
    (``common.jit_helpers._p_operand``'s reshape and transpose), which puts the values S's layout gives each
    thread where the 8-bit operand's layout wants them."""
    p = p.to(dtype)
    if PV_ORDER:
        M: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        p = p.reshape([M, N // 32, 2, 2, 2, 2, 2]).permute((0, 1, 2, 4, 5, 3, 6)).reshape([M, N])
    return gl.convert_layout(p, p_layout)


@gluon.constexpr_function
def _split_key_loop(head_dim, fp8):
    """Whether ``_consume`` runs its key tiles in two loops (SPLIT_KEY_LOOP_DIMS; 16-bit inputs only)."""
    return not fp8 and head_dim in SPLIT_KEY_LOOP_DIMS


@gluon.constexpr_function
def _fma_quarter(head_dim, fp8, is_causal):
    """Whether ``_exp2`` puts a quarter of a tile's exponentials on the FMA units: at EXP2_FMA_DIMS without a
    causal mask, 16-bit inputs only."""
    return not fp8 and not is_causal and head_dim in EXP2_FMA_DIMS


@gluon.constexpr_function
def _split_kv(dtype):
    """Whether K and V of a ring slot are on barriers of their own (V's past K's): with 16-bit inputs, where
    the earlier release of K shortened the forward; not with FP8, whose loop is bound by its issue slots and
    ran longer with the second pipeline's waits and arrivals (benchmarks/NOTES.md)."""
    return dtype.primitive_bitwidth == 16


@gluon.jit
def _v_bar(slot, STAGES: gl.constexpr, SPLIT: gl.constexpr):
    """The index of slot ``slot``'s V barriers: their own past K's (SPLIT), or K's."""
    return STAGES + slot if SPLIT else slot


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, kv_ready, slot, key, off_z, off_h_kv, STAGES: gl.constexpr):
    """The K and V tiles of keys from ``key`` by TMA into ring slot ``slot``, completing K's barrier
    ``kv_ready[slot]`` and V's (``_v_bar``)."""
    _load_k(k_desc, v_desc, k_smem, kv_ready, slot, key, off_z, off_h_kv)
    _load_v(k_desc, v_desc, v_smem, kv_ready, slot, key, off_z, off_h_kv, STAGES)


@gluon.jit
def _load_k(k_desc, v_desc, k_smem, kv_ready, slot, key, off_z, off_h_kv):
    """The K tile of keys from ``key`` into slot ``slot``, on ``kv_ready[slot]``, which also expects the V
    tile's bytes where V shares K's barrier (``_split_kv``)."""
    if _split_kv(k_desc.dtype):
        mbarrier.expect(kv_ready.index(slot), k_desc.block_type.nbytes)
    else:
        mbarrier.expect(kv_ready.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [off_z, off_h_kv, key, 0], kv_ready.index(slot), k_smem.index(slot))


@gluon.jit
def _load_v(k_desc, v_desc, v_smem, kv_ready, slot, key, off_z, off_h_kv, STAGES: gl.constexpr):
    """The V tile of keys from ``key`` into slot ``slot``, on V's barrier (``_v_bar``; its bytes expected
    there only where it is V's own)."""
    SPLIT: gl.constexpr = _split_kv(k_desc.dtype)
    if SPLIT:
        mbarrier.expect(kv_ready.index(STAGES + slot), v_desc.block_type.nbytes)
    _tma_load(v_desc, _v_coord(off_z, off_h_kv, key, v_desc.dtype.primitive_bitwidth == 8),
              kv_ready.index(_v_bar(slot, STAGES, SPLIT)), v_smem.index(slot))


@gluon.jit
def _load_q(q_desc, q_bar, q_smem, row_start, off_z, off_h):
    """Q's rows from ``row_start`` of (batch, head) by TMA into ``q_smem``, completing a phase of ``q_bar``."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [off_z, off_h, row_start, 0], q_bar, q_smem)


@gluon.jit
def _prefetch_q(q_desc, q_bar, q_smem, next_q):
    """``_load_q`` of the next row block's ``next_q`` (rows from, batch·head, heads): none where rows from is
    negative (no row block follows). (Two values held through the key loop: a third spilled there.)"""
    row_start, off_hz, H = next_q
    if row_start >= 0:
        _load_q(q_desc, q_bar, q_smem, row_start, off_hz // H, off_hz % H)


@gluon.jit
def _v_coord(off_z, off_h_kv, key, FP8: gl.constexpr):
    """Where the value tile of keys from ``key`` starts: (B, H_kv, Lk, D) values, or FP8's column-major
    values described as (B, H_kv, D, Lk)."""
    if FP8:
        return [off_z, off_h_kv, 0, key]
    return [off_z, off_h_kv, key, 0]


@gluon.jit
def _v_operand(v_tile, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, FP8: gl.constexpr):
    """A value tile as P V's B operand, (BLOCK_N, D): as stored, or FP8's (D, BLOCK_N) tile transposed (an
    8-bit B operand must be K-major: keys contiguous)."""
    if FP8:  # (one return: the two branches' tiles differ in type)
        operand = v_tile.reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))
    else:
        operand = v_tile.reshape([BLOCK_N, HEAD_DIM])
    return operand


@gluon.jit
def _ws_producer(k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, off_z, off_h_kv, n_tiles, base,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The producer warp: a row block's ``n_tiles`` K and V tiles into the ring, its tile t being the
    ring's tile base + t, into slot (base + t) % STAGES, K once the consumers released that slot's previous
    K, then V once they released its previous V (``_consume``'s barriers; FP8: both at once; the ring's
    first round passes: a fresh barrier's phase before 0 counts as complete)."""
    SPLIT: gl.constexpr = _split_kv(k_desc.dtype)
    for t in range(n_tiles):
        slot = (base + t) % STAGES
        phase = (((base + t) // STAGES) & 1) ^ 1
        mbarrier.wait(kv_empty.index(slot), phase)
        _load_k(k_desc, v_desc, k_smem, kv_ready, slot, t * BLOCK_N, off_z, off_h_kv)
        if SPLIT:
            mbarrier.wait(kv_empty.index(STAGES + slot), phase)
        _load_v(k_desc, v_desc, v_smem, kv_ready, slot, t * BLOCK_N, off_z, off_h_kv, STAGES)


@gluon.jit
def _gluon_attn_fwd_ws(
    q_desc, k_desc, v_desc, o_desc, Lse,
    scale, H, GROUP, Lq, Lk, causal_shift,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, WITH_LSE: gl.constexpr, NEGATIVE_SCALE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``_gluon_attn_fwd`` with FlashAttention-3's producer: one warp of its own issues the K/V
    copies (``_ws_producer``) while the ``num_warps`` consumer warps (``_consume`` with PRODUCER,
    the default partition) only wait for tiles, multiply and run the softmax; slots go back through
    ``kv_empty``."""
    dtype: gl.constexpr = q_desc.dtype
    start_m, off_hz, off_z, off_h, off_h_kv = _program(H, GROUP)
    q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bars = _barriers(1, 1)
    kv_ready = _barriers(2 * STAGES, 1)
    kv_empty = _barriers(2 * STAGES, 1)
    fence_async_shared()
    q_bar = q_bars.index(0)
    n_tiles = _key_tiles(Lk, start_m, causal_shift, BLOCK_M, BLOCK_N, IS_CAUSAL)
    gl.warp_specialize([
        (_consume, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, q_bar, q_bar, o_desc,
                    q_smem, Lse, scale, 1.0, 1.0, Lq, Lk, causal_shift, off_z, off_h, off_h_kv, off_hz,
                    start_m * BLOCK_M, n_tiles, 0, 0, True, (-1, 0, 1), BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                    IS_CAUSAL, WITH_LSE, True, False, 0, NEGATIVE_SCALE, False, False)),
        (_ws_producer, (k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, off_z, off_h_kv, n_tiles, 0, BLOCK_N,
                        STAGES)),
    ], [1], [PRODUCER_REGS])
    _invalidate(q_bars, 1)
    _invalidate(kv_ready, 2 * STAGES)
    _invalidate(kv_empty, 2 * STAGES)


@gluon.jit
def _pp_blocks(Lq, BH, ROWS: gl.constexpr, PERSISTENT: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """(row blocks a head, first, end, step) of the work items a ping-pong partition runs: a persistent
    program's items p, p + P, ... of every head's items (``_pp_item``); otherwise the one of its grid cell."""
    n_blocks = gl.cdiv(Lq, ROWS)
    if PERSISTENT:
        first = gl.program_id(0)
        count = (gl.cdiv(n_blocks, 2) if IS_CAUSAL else n_blocks) * BH
        step = gl.num_programs(0)
    else:
        first = 0
        count = 1
        step = 1
    return n_blocks, first, count, step


@gluon.jit
def _pp_item(t, n_blocks, PERSISTENT: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """(head item, batch·head, row blocks in it) of work item t. A persistent causal item is a pair of row
    blocks, the head's k-th longest and k-th shortest (one, where they meet), so that every item costs
    about the same keys: striding items of unequal cost over the programs would give some programs only
    long blocks. Otherwise an item is one row block."""
    n_items = gl.cdiv(n_blocks, 2) if PERSISTENT and IS_CAUSAL else n_blocks
    k = t % n_items
    halves = 2 - (2 * k + 1 == n_blocks).to(gl.int32) if PERSISTENT and IS_CAUSAL else 1
    return k, t // n_items, halves


@gluon.jit
def _pp_next(t, s, n_blocks, step, PERSISTENT: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """The work position (item, row block in it) after row block s of item t: the item's next block, or
    the program's next item's first."""
    _k, _hz, halves = _pp_item(t, n_blocks, PERSISTENT, IS_CAUSAL)
    done = (s + 1 >= halves).to(gl.int32)
    return t + done * step, (s + 1) * (1 - done)


@gluon.jit
def _pp_block(t, s, n_blocks, H, GROUP, PERSISTENT: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Row block s of work item t (``_pp_item``) as (row block, batch·head, batch, head, K/V head): a
    persistent program's first the head's k-th from the end (causal: the longest first), then its k-th; a
    head's items run one after another, so the programs running at once share few heads, whose keys and
    values stay in L2. Otherwise the grid cell's (``_program``)."""
    if PERSISTENT:
        k, off_hz, _halves = _pp_item(t, n_blocks, PERSISTENT, IS_CAUSAL)
        start_m = n_blocks - 1 - k if s == 0 else k
        off_h = off_hz % H
        block = (start_m, off_hz, off_hz // H, off_h, off_h // GROUP)
    else:
        block = _program(H, GROUP)
    return block


@gluon.jit
def _pp_consumer(q_desc, k_desc, v_desc, o_desc, Lse, QD, KD, VD, stride_qdz, stride_qdh, stride_kdz, stride_kdh,
                 stride_vdz, stride_vdh, q_smem, k_smem, v_smem, o_smem, q_bars, turns, kv_ready, kv_empty, scale, H,
                 GROUP, Lq, Lk, causal_shift, BH, C: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 WITH_LSE: gl.constexpr, NEGATIVE_SCALE: gl.constexpr, PERSISTENT: gl.constexpr,
                 PREFETCH_Q: gl.constexpr, PV_ORDER: gl.constexpr):
    """Consumer warp group C of ``_gluon_attn_fwd_pp``: rows C·BLOCK_M on of each row block it runs (one, or
    a persistent program's every ``_pp_block``), waiting on turn C and completing turn C + 1 (the first's
    first wait passes at once). Every consumer runs the rounds of the whole row block (their turns must
    pair up), and the ring's tiles run on across row blocks (``_consume``'s ``base``). PREFETCH_Q: each
    row block loads the next one's Q (``_consume``)."""
    FP8: gl.constexpr = q_desc.dtype.primitive_bitwidth == 8
    ROWS: gl.constexpr = CONSUMERS * BLOCK_M
    n_blocks, first, count, step = _pp_blocks(Lq, BH, ROWS, PERSISTENT, IS_CAUSAL)
    base = 0
    i = 0
    for t in range(first, count, step):
        _k, _hz, halves = _pp_item(t, n_blocks, PERSISTENT, IS_CAUSAL)
        for s in range(halves):
            start_m, off_hz, off_z, off_h, off_h_kv = _pp_block(t, s, n_blocks, H, GROUP, PERSISTENT, IS_CAUSAL)
            next_q = (-1, 0, 1)
            if PREFETCH_Q:
                next_t, next_s = _pp_next(t, s, n_blocks, step, PERSISTENT, IS_CAUSAL)
                next_m, next_hz, _nz, _nh, _nkv = _pp_block(next_t, next_s, n_blocks, H, GROUP, PERSISTENT,
                                                            IS_CAUSAL)
                next_q = (gl.where(next_t < count, next_m * ROWS + C * BLOCK_M, -1), next_hz, H)
            if FP8:
                qk_descale = (gl.load(QD + off_z * stride_qdz + off_h_kv * stride_qdh)
                              * gl.load(KD + off_z * stride_kdz + off_h_kv * stride_kdh))
                v_descale = gl.load(VD + off_z * stride_vdz + off_h_kv * stride_vdh)
            else:
                qk_descale = 1.0
                v_descale = 1.0
            n_tiles = _key_tiles(Lk, start_m, causal_shift, ROWS, BLOCK_N, IS_CAUSAL)
            _consume(q_desc, k_desc, v_desc, q_smem.index(C), k_smem, v_smem, q_bars.index(C), kv_ready, kv_empty,
                     turns.index(C), turns.index((C + 1) % CONSUMERS), o_desc, o_smem.index(C), Lse, scale,
                     qk_descale, v_descale, Lq, Lk, causal_shift, off_z, off_h, off_h_kv, off_hz,
                     start_m * ROWS + C * BLOCK_M, n_tiles, base, i & 1, i == 0, next_q, BLOCK_M, BLOCK_N, HEAD_DIM,
                     STAGES, IS_CAUSAL, WITH_LSE, True, True, 1 if C == 0 else 0, NEGATIVE_SCALE, PREFETCH_Q,
                     PV_ORDER)
            base += n_tiles
            i += 1
    if PREFETCH_Q:
        tma.store_wait(0)  # (the last row block's output)


@gluon.jit
def _pp_producer(k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, H, GROUP, Lq, Lk, causal_shift, BH,
                 ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 PERSISTENT: gl.constexpr):
    """The producer warp of ``_gluon_attn_fwd_pp``: the K/V tiles of each row block it runs (one, or a
    persistent program's every ``_pp_block``) into the ring, the next row block's as soon as slots free
    up (they load under the consumers' last tiles and epilogue)."""
    n_blocks, first, count, step = _pp_blocks(Lq, BH, ROWS, PERSISTENT, IS_CAUSAL)
    base = 0
    for t in range(first, count, step):
        _k, _hz, halves = _pp_item(t, n_blocks, PERSISTENT, IS_CAUSAL)
        for s in range(halves):
            start_m, off_hz, off_z, off_h, off_h_kv = _pp_block(t, s, n_blocks, H, GROUP, PERSISTENT, IS_CAUSAL)
            n_tiles = _key_tiles(Lk, start_m, causal_shift, ROWS, BLOCK_N, IS_CAUSAL)
            _ws_producer(k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, off_z, off_h_kv, n_tiles, base,
                         BLOCK_N, STAGES)
            base += n_tiles


@gluon.jit
def _gluon_attn_fwd_pp(
    q_desc, k_desc, v_desc, o_desc, Lse, QD, KD, VD,
    stride_qdz, stride_qdh, stride_kdz, stride_kdh, stride_vdz, stride_vdh,
    scale, H, GROUP, Lq, Lk, causal_shift, BH,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, WITH_LSE: gl.constexpr, NEGATIVE_SCALE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr, PREFETCH_Q: gl.constexpr,
    PV_ORDER: gl.constexpr, num_warps: gl.constexpr,
):
    """FlashAttention-3's schedule: a program of CONSUMERS x BLOCK_M rows, CONSUMERS (2 or 3) consumer
    warp groups of ``num_warps`` warps (the default partition and workers) owning BLOCK_M rows each, taking
    turns (``_consume`` with PINGPONG: each one's products issued once the one before it issued its own,
    consumer c waiting on turn c and completing turn c + 1, so one's softmax runs under the others'
    products), and a producer warp filling the K/V ring they share (``_ws_producer``; a slot's K, and its V,
    goes back once every consumer is done with it: ``kv_empty`` counts CONSUMERS arrivals). q_desc's blocks are (1, 1,
    BLOCK_M, D). BH: B·H.

    PERSISTENT (FlashAttention-3's persistent programs): a grid of at most one program an SM, program p
    running row blocks p, p + P, ... of ``_pp_block``'s order, its barriers, ring and turns carried from
    one to the next, so that the next row block's keys load under this one's last tiles and epilogue
    instead of a new program starting cold; PREFETCH_Q (persistent, where shared memory holds an output tile
    beside Q's): each consumer loads its next row block's Q under this one's last tile and epilogue. Otherwise
    one program a row block, grid (row blocks, B·H).

    FP8 (float8_e4m3fn q, k and v; v_desc over the column-major values seen as (B, H_kv, D, Lk)): QD, KD,
    VD are the (B, H_kv) float32 descales (FlashAttention-3's: the query's indexed by its K/V head), each
    with its two strides; the output, 16-bit, gets tiles of its own. Otherwise they are not read.
    PV_ORDER (FP8): the values' keys are in the P·V order (``_consume``)."""
    dtype: gl.constexpr = q_desc.dtype
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    v_block: gl.constexpr = v_desc.block_type.shape
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, v_block[2], v_block[3]], v_desc.layout)
    if FP8 or PREFETCH_Q:
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS, 1, 1, BLOCK_M, HEAD_DIM], o_desc.layout)
    else:
        o_smem = q_smem
    q_bars = _barriers(CONSUMERS, 1)
    turns = _barriers(CONSUMERS, 1)
    kv_ready = _barriers(2 * STAGES, 1)
    kv_empty = _barriers(2 * STAGES, CONSUMERS)
    fence_async_shared()
    # (each warp group's arguments written out: a partition's function and arguments cannot be a value)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_pp_consumer, (q_desc, k_desc, v_desc, o_desc, Lse, QD, KD, VD, stride_qdz, stride_qdh, stride_kdz,
                            stride_kdh, stride_vdz, stride_vdh, q_smem, k_smem, v_smem, o_smem, q_bars, turns,
                            kv_ready, kv_empty, scale, H, GROUP, Lq, Lk, causal_shift, BH, 0, CONSUMERS,
                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL, WITH_LSE, NEGATIVE_SCALE,
                            PERSISTENT, PREFETCH_Q, PV_ORDER)),
            (_pp_consumer, (q_desc, k_desc, v_desc, o_desc, Lse, QD, KD, VD, stride_qdz, stride_qdh, stride_kdz,
                            stride_kdh, stride_vdz, stride_vdh, q_smem, k_smem, v_smem, o_smem, q_bars, turns,
                            kv_ready, kv_empty, scale, H, GROUP, Lq, Lk, causal_shift, BH, 1, CONSUMERS,
                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL, WITH_LSE, NEGATIVE_SCALE,
                            PERSISTENT, PREFETCH_Q, PV_ORDER)),
            (_pp_producer, (k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, H, GROUP, Lq, Lk, causal_shift,
                            BH, CONSUMERS * BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, PERSISTENT)),
        ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_pp_consumer, (q_desc, k_desc, v_desc, o_desc, Lse, QD, KD, VD, stride_qdz, stride_qdh, stride_kdz,
                            stride_kdh, stride_vdz, stride_vdh, q_smem, k_smem, v_smem, o_smem, q_bars, turns,
                            kv_ready, kv_empty, scale, H, GROUP, Lq, Lk, causal_shift, BH, 0, CONSUMERS,
                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL, WITH_LSE, NEGATIVE_SCALE,
                            PERSISTENT, PREFETCH_Q, PV_ORDER)),
            (_pp_consumer, (q_desc, k_desc, v_desc, o_desc, Lse, QD, KD, VD, stride_qdz, stride_qdh, stride_kdz,
                            stride_kdh, stride_vdz, stride_vdh, q_smem, k_smem, v_smem, o_smem, q_bars, turns,
                            kv_ready, kv_empty, scale, H, GROUP, Lq, Lk, causal_shift, BH, 1, CONSUMERS,
                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL, WITH_LSE, NEGATIVE_SCALE,
                            PERSISTENT, PREFETCH_Q, PV_ORDER)),
            (_pp_consumer, (q_desc, k_desc, v_desc, o_desc, Lse, QD, KD, VD, stride_qdz, stride_qdh, stride_kdz,
                            stride_kdh, stride_vdz, stride_vdh, q_smem, k_smem, v_smem, o_smem, q_bars, turns,
                            kv_ready, kv_empty, scale, H, GROUP, Lq, Lk, causal_shift, BH, 2, CONSUMERS,
                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL, WITH_LSE, NEGATIVE_SCALE,
                            PERSISTENT, PREFETCH_Q, PV_ORDER)),
            (_pp_producer, (k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, H, GROUP, Lq, Lk, causal_shift,
                            BH, CONSUMERS * BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, PERSISTENT)),
        ], [num_warps, num_warps, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    _invalidate(q_bars, CONSUMERS)
    _invalidate(turns, CONSUMERS)
    _invalidate(kv_ready, 2 * STAGES)
    _invalidate(kv_empty, 2 * STAGES)


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether TMA can copy blocks of ``t`` (4-D, unit last stride, 16-byte aligned base and strides)."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * size) % 16 == 0 for s in t.stride()[:-1]))


# ATTENTION_GLUON=1: each head dim's variant at every length (a non-persistent one measured fastest at long
# lengths, benchmarks/NOTES.md); unset, the Triton backend's config table says, per key
# (common.configs.ConfigTable.lookup_gluon, written by ``tune --passes gluon``); 0: the tl kernel everywhere.
FORCED = {64: "pingpong", 128: "pingpong", 256: "pingpong"}
# Unset, a plan smaller than this (FLOPs, 4·B·H·Lq·Lk·D, half where causal) stays on the tl kernel whatever
# the table says: the table is timed on large batches, and below this size the Gluon path's launch (bound, but
# four descriptors a call) costs a user's loop more than its kernel saves (tools/probe.py gluon_host,
# benchmarks/NOTES.md).
MIN_FLOPS = 3e10
VARIANTS = {"one": {}, "producer": {"specialized": True}, "pingpong": {"pingpong": True},
            "persistent": {"pingpong": True, "persistent": True}}


def gluon_switch() -> str:
    """The ``ATTENTION_GLUON`` environment variable: "" (unset: where measured faster), "0" (never) or "1"
    (every plan a Gluon kernel serves); anything else is an error."""
    switch = os.environ.get("ATTENTION_GLUON", "")
    if switch not in ("", "0", "1"):
        raise ValueError(f"ATTENTION_GLUON must be 0, 1 or unset, got {switch!r}")
    return switch


def variant(plan) -> str | None:
    """The Gluon variant ("one", "producer", "pingpong" or "persistent") that runs ``plan`` (a
    ``common.plan.ForwardPlan``) on the Triton backend, or None for the tl kernel."""
    switch = gluon_switch()
    if switch == "0":
        return None
    q = plan.query
    if switch == "1":
        chosen = FORCED.get(q.shape[-1])
    elif not large_enough(*q.shape[:3], plan.key.shape[2], q.shape[3], plan.band is not None):
        return None
    else:  # (the table before serves(): a call's host time asks the device nothing it need not)
        chosen = _table().lookup_gluon(q.shape[-1], q.dtype, plan.band is not None,
                                       min(q.shape[2], plan.key.shape[2]))
    if chosen is None or chosen == "tl" or not serves(plan):
        return None
    if plan.descales is not None and not VARIANTS[chosen].get("pingpong"):
        return None  # (FP8: the ping-pong variants only)
    return chosen


def large_enough(B: int, H: int, Lq: int, Lk: int, D: int, causal: bool) -> bool:
    """Whether a call of these sizes does at least MIN_FLOPS of work (causal: half)."""
    return 4 * B * H * Lq * Lk * D / (2 if causal else 1) >= MIN_FLOPS


def _table():
    from common.backends import get_backend

    return get_backend("triton").configs


def serves(plan) -> bool:
    """Whether this kernel runs a ``common.plan.ForwardPlan``: an sm_90 GPU, float16/bfloat16 with D = Dv
    in HEAD_DIMS, or FP8 (float8_e4m3fn query, keys and values, descales per batch and K/V head, nothing
    widened, the values column-major as the plan copies them) with D = Dv in FP8_HEAD_DIMS; heads not packed,
    no mask, dropout, soft-capping, sinks, ALiBi, packed sequences, split or running result, a band with no
    left edge (causal, either alignment, or a right window alone: row i sees keys up to i + band[1]),
    TMA-ready inputs and output, B·H within a grid axis (the launches' second, CUDA's 65535; the tl kernel
    takes more)."""
    q, k, v = plan.query, plan.key, plan.value
    if plan.descales is None:
        inputs = (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in HEAD_DIMS and _tma_ready(v))
    else:
        # (both products in e4m3: widen_k Widen.NONE, widen_v NONE or PV_ORDER)
        inputs = (q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn and q.shape[-1] in FP8_HEAD_DIMS
                  and plan.descale_kind == 1 and plan.widen_k == Widen.NONE
                  and plan.widen_v in (Widen.NONE, Widen.PV_ORDER) and v.stride(2) == 1
                  and _tma_ready(v.transpose(2, 3)))
    return (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0) and inputs
            and q.shape[0] * q.shape[1] <= MAX_GRID_AXIS
            and k.shape[-1] == q.shape[-1] == v.shape[-1] and q.shape[1] == plan.shape[1]
            and plan.attn_mask is None and not plan.dropout and plan.softcap == 0.0 and plan.sinks is None
            and plan.row_bands is None and plan.alibi is None and not plan.split and not plan.resume
            and (plan.band is None or plan.band[0] <= 1 - q.shape[2])
            and all(_tma_ready(t) for t in (q, k, plan.out)))


def forward_plan(plan, chosen: str):
    """Run a plan this kernel serves (``serves``) through variant ``chosen`` (``variant``'s answer) into
    its buffers: ``(plan.out, plan.lse)``."""
    forward(plan.query, plan.key, plan.value, plan.scale, None if plan.band is None else plan.band[1],
            plan.with_lse, plan.out, plan.lse, **VARIANTS[chosen], descales=plan.descales,
            pv_order=plan.widen_v == Widen.PV_ORDER)
    return plan.out, plan.lse


class BoundGluon:
    """A Gluon forward launch bound to a plan's layout (the Triton backend's ``bind_forward``; a later
    call of that layout passes its tensors in ``ForwardPlan.ROLES`` order, ``common.reuse.BoundLaunch``):
    what a call then does is four descriptors rebased on its tensors and, once the compiled kernel is
    known, Triton's launcher called directly (``common.launch.BoundKernel.run_compiled``'s path),
    without planning, ``serves``' checks or Triton's JIT dispatch again. A call whose query, keys or
    values do not start at a 16-byte multiple (TMA's rule; the layout's strides are the plan's) runs the
    tl kernel's bound launch (``fallback``)."""

    def __init__(self, plan, chosen: str, fallback):
        descales = plan.descales
        self.kernel, grid, args, self.meta = _launch(
            plan.query, plan.key, plan.value, plan.out, plan.lse, plan.scale,
            None if plan.band is None else plan.band[1], plan.with_lse, descales=descales, config=None,
            pv_order=plan.widen_v == Widen.PV_ORDER, **VARIANTS[chosen])
        self.grid = (*grid, 1)
        self.fallback = fallback
        self.templates = args[:4]  # (rebased on each call's tensors; the plan's are not kept)
        for template in self.templates:
            template.base = None
        # the tensor each pointer argument takes (its role's index): the log-sum-exp (or the output,
        # never written), then ping-pong's three descales (or the output, never read)
        out, lse = 3, 4
        self.slots = ((4, lse if plan.with_lse else out),)
        if self.kernel is _gluon_attn_fwd_pp:
            self.slots += tuple((5 + i, 7 + i if descales is not None else out) for i in range(3))
        self.fp8 = descales is not None
        self.args = list(args)
        for position, _ in self.slots:
            self.args[position] = None  # (the plan's tensors are not kept)
        self.args[:4] = [None] * 4
        self.constexprs = _runner_constexprs(self.kernel, self.meta, len(args))
        self.kernels: dict = {}  # the compiled kernel per alignment of the call's descales (common.launch.alignment)

    def __call__(self, tensors) -> None:
        if (tensors[0].data_ptr() | tensors[1].data_ptr() | tensors[2].data_ptr()) & 15:
            self.fallback(tensors)
            return
        args = self.args.copy()
        args[:4] = [_rebased(t, tensors[i]) for i, t in enumerate(self.templates)]
        key = alignment([tensors[7].data_ptr(), tensors[8].data_ptr(), tensors[9].data_ptr()]) if self.fp8 else 0
        launch_kept(self.kernels, key, self.kernel, self.grid, self.meta, self.constexprs, args,
                    [(position, tensors[role]) for position, role in self.slots])


def _runner_constexprs(kernel, meta: dict, num_args: int) -> list:
    """``kernel``'s constexprs from ``meta`` in signature order, which a compiled kernel's runner takes after
    the ``num_args`` runtime arguments (every parameter in signature order: these kernels declare their
    constexprs after their runtime parameters, checked here)."""
    params = compat.jit_parameters(kernel)
    assert all(constexpr == (num >= num_args) for _, num, constexpr, _ in params)
    return [meta[name] for name, _, constexpr, _ in params if constexpr]


def launch_kept(kernels: dict, key, kernel, grid, meta: dict, constexprs: list, args: list, slots) -> None:
    """A bound Gluon launch (``BoundGluon``, ``gluon_backward.BoundOnePass``): ``args``, the runtime
    arguments, with each ``(position, tensor)`` of ``slots`` put in. The first launch of an alignment
    ``key`` (Triton specialises a kernel on its pointers' alignment) goes through ``kernel``'s JIT, which
    compiles it; the compiled kernel is kept in ``kernels`` where Triton's launcher can run it directly (no
    scratch memory to allocate), and later launches call it with the tensors' addresses and the
    ``constexprs`` (``common.launch.launch_compiled``)."""
    compiled = kernels.get(key)
    if compiled is None:
        for position, tensor in slots:
            args[position] = tensor
        compiled = kernel[grid[:2]](*args, **meta)
        if hasattr(compiled, "run") and not compat.needs_launch_scratch(compiled):
            kernels[key] = compiled
        return
    for position, tensor in slots:
        args[position] = tensor.data_ptr()
    launch_compiled(compiled, grid, (*args, *constexprs))


def _rebased(descriptor, base):
    """A copy of a TMA descriptor over ``base`` (a tensor of the descriptor's dtype, shape and strides,
    16-byte aligned: its checks are not repeated). Its fields copied as a dict where it has one (cheaper
    than ``copy.copy``, and a call rebases four)."""
    fields = getattr(descriptor, "__dict__", None)
    if fields is None:
        rebased = copy.copy(descriptor)
    else:
        rebased = object.__new__(type(descriptor))
        rebased.__dict__.update(fields)
    rebased.base = base
    return rebased


def tile(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, STAGES, num_warps) for a head dim: 128 rows over two warp groups (a first
    choice, to be measured and moved to the config table)."""
    return {64: (128, 128, 3, 8), 128: (128, 128, 2, 8), 256: (128, 64, 2, 8)}[head_dim]


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv,
              torch.float32: gl.float32}


def descriptor(t, rows: int):
    """A TMA descriptor of a (B, H, L, D) float16/bfloat16/float8_e4m3fn (or float32: the one-pass backward's
    dQ sum) tensor with (1, 1, rows, D) blocks."""
    block = (1, 1, rows, t.shape[-1])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _shared_layout(block, t.dtype))


@functools.lru_cache(maxsize=64)
def _shared_layout(block: tuple, dtype: torch.dtype):
    """The shared-memory layout of a TMA block (made once per block and dtype: it costs a call's
    host more than the descriptor around it)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def value_descriptor(v, block_n: int):
    """The values' TMA descriptor: ``descriptor``'s, or for FP8 values (which must be column-major,
    ``v.stride(2) == 1``: an 8-bit B operand of P V must have its keys contiguous) the (B, H_kv, D, Lk)
    view's with (1, 1, D, block_n) blocks."""
    if v.dtype != torch.float8_e4m3fn:
        return descriptor(v, block_n)
    if v.stride(2) != 1:
        raise ValueError("the Gluon forward takes FP8 values column-major (value.stride(2) == 1)")
    values = v.transpose(2, 3)
    block = (1, 1, v.shape[-1], block_n)
    return TensorDescriptor(values, list(values.shape), list(values.stride()), list(block),
                            _shared_layout(block, v.dtype))


def descriptors(q, k, v, out, block_m: int, block_n: int):
    """TMA descriptors of (B, H, L, D) q, k, v and out with (1, 1, rows, D) blocks (the output's as the
    query's: it is written through the query's shared tile)."""
    return (descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), descriptor(out, block_m))


def forward(q, k, v, scale: float, causal_shift: int | None, with_lse: bool, out=None, lse=None,
            specialized: bool = False, config: tuple[int, int, int, int] | None = None, pingpong: bool = False,
            descales=None, out_dtype=torch.bfloat16, persistent: bool = False, prefetch_q: bool | None = None,
            pv_order: bool = False):
    """q (B, H, Lq, D), k/v (B, H_kv, Lk, D) -> out (B, H, Lq, D) (and lse (B, H, Lq) float32).
    ``causal_shift``: None (every row sees every key) or s, row i seeing keys j <= i + s (0: causal
    top-left; Lk - Lq: bottom-right). ``specialized``: the variant with a producer warp. ``config``:
    (BLOCK_M, BLOCK_N, STAGES, num_warps) instead of ``tile``'s (a probe's sweep). ``pingpong``: the
    variant with num_warps / 4 consumer warp groups (two in ping-pong, or three in a ring) and a
    producer warp, each consumer BLOCK_M / consumers rows. ``persistent`` (with ``pingpong``): at most
    one program an SM, each running row blocks one after another (``_gluon_attn_fwd_pp``'s PERSISTENT);
    ``prefetch_q`` (persistent): each row block loads the next one's Q (``_gluon_attn_fwd_pp``'s
    PREFETCH_Q; None: where an output tile fits in shared memory beside Q's, ``_output_tile_fits``).

    FP8 (ping-pong only): q, k, v float8_e4m3fn, v column-major (``v.stride(2) == 1``: the layout
    ``common.plan.value_columns`` makes), ``descales`` their (B, H_kv) float32 descales (q's indexed by
    its K/V head), the output ``out_dtype`` (bfloat16 or float16) unless ``out`` is given; ``pv_order``:
    v's keys in the P·V order (``common.plan.Widen.PV_ORDER``: value_columns' copy with pv_order)."""
    B, H, Lq, D = q.shape
    if q.dtype == torch.float8_e4m3fn and not pingpong:
        raise ValueError("the Gluon forward takes FP8 inputs in its ping-pong variant only (pingpong=True)")
    if persistent and not pingpong:
        raise ValueError("the Gluon forward's persistent programs are the ping-pong variant's (pingpong=True)")
    if prefetch_q and not persistent:
        raise ValueError("prefetch_q=True loads a persistent program's next Q (persistent=True)")
    if pv_order and (q.dtype != torch.float8_e4m3fn or not pv_order_fits(k.shape[2])):
        raise ValueError(f"pv_order=True reads FP8 values of whole groups of {PV_GROUP} keys (common.plan.PV_GROUP)")
    if out is None:
        fp8 = q.dtype == torch.float8_e4m3fn
        out = torch.empty(B, H, Lq, D, dtype=out_dtype if fp8 else q.dtype, device=q.device)
    if with_lse and lse is None:
        lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    kernel, grid, args, meta = _launch(q, k, v, out, lse, scale, causal_shift, with_lse, specialized, config,
                                       pingpong, descales, persistent, prefetch_q, pv_order)
    kernel[grid](*args, **meta)
    return (out, lse) if with_lse else out


def _launch(q, k, v, out, lse, scale, causal_shift, with_lse, specialized=False, config=None, pingpong=False,
            descales=None, persistent=False, prefetch_q=None, pv_order=False):
    """(kernel, grid, args, meta) of ``forward``'s launch into ``out`` (and ``lse``): the runtime
    arguments in signature order, the four TMA descriptors (q, k, v, out) first, then the log-sum-exp
    (``out`` where there is none: never written) and, for ping-pong, the three descales (``out`` without
    FP8: never read); ``meta`` the constexprs and launch options by name."""
    B, H, Lq, D = q.shape
    H_kv, Lk = k.shape[1], k.shape[2]
    block_m, block_n, stages, num_warps = config or (pingpong_tile(D, q.dtype) if pingpong else tile(D))
    grid = (triton.cdiv(Lq, block_m), B * H)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D, STAGES=stages, IS_CAUSAL=causal_shift is not None,
                WITH_LSE=with_lse, NEGATIVE_SCALE=scale < 0 and descales is None, num_warps=num_warps,
                **COMPILE_OPTIONS)
    scalars = (scale, H, H // H_kv, Lq, Lk, 0 if causal_shift is None else causal_shift)
    lse_arg = lse if with_lse else out
    if not pingpong:
        descs = (descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), descriptor(out, block_m))
        if specialized:
            return _gluon_attn_fwd_ws, grid, (*descs, lse_arg, *scalars), dict(meta, PRODUCER_REGS=PRODUCER_REGS)
        return _gluon_attn_fwd, grid, (*descs, lse_arg, *scalars), meta
    # ping-pong: programs of block_m rows, num_warps / 4 consumer warp groups (2 or 3) of block_m / consumers rows
    consumers = num_warps // 4
    rows = block_m // consumers
    descs = (descriptor(q, rows), descriptor(k, block_n), value_descriptor(v, block_n), descriptor(out, rows))
    if descales is not None:
        qd, kd, vd = descales
        descale_args = (qd, kd, vd, *qd.stride(), *kd.stride(), *vd.stride())
    else:
        descale_args = (out, out, out, 0, 0, 0, 0, 0, 0)  # (never read)
    fits = _output_tile_fits(block_m, block_n, stages, D, q.element_size(), out.element_size())
    if prefetch_q and not fits:
        raise ValueError(f"prefetch_q=True needs an output tile beside Q's in shared memory, which the tile "
                         f"{(block_m, block_n, stages, num_warps)} at head dim {D} leaves no room for")
    if prefetch_q is None:
        prefetch_q = persistent and fits
    meta.update(BLOCK_M=rows, PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS[consumers], CONSUMERS=consumers,
                PERSISTENT=persistent, PREFETCH_Q=bool(prefetch_q), PV_ORDER=bool(pv_order), num_warps=4)
    if persistent:  # (one program an SM: a consumer warp group's registers and the ring fill it)
        items = triton.cdiv(grid[0], 2) if causal_shift is not None else grid[0]  # (causal: pairs, _pp_item)
        grid = (min(items * grid[1], _sm_count(q.device)), 1)
    return _gluon_attn_fwd_pp, grid, (*descs, lse_arg, *descale_args, *scalars, B * H), meta


# shared memory a program may take on sm_90 (H100, H200): 227 KiB
SM90_SHARED_BYTES = 232448


def _output_tile_fits(block_m: int, block_n: int, stages: int, head_dim: int, size: int, out_size: int) -> bool:
    """Whether a ping-pong program's output tiles fit in shared memory beside its Q tiles and K/V ring
    (``size``, ``out_size``: the inputs' and the output's bytes an element; a kilobyte left for the
    barriers): at D 64 in 16 bits and every FP8 tile, not at D 128 and 256 in 16 bits."""
    tiles = block_m * head_dim * (size + out_size) + 2 * stages * block_n * head_dim * size
    return tiles + 1024 <= SM90_SHARED_BYTES


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors."""
    return torch.cuda.get_device_properties(device).multi_processor_count


# each ping-pong consumer warp group's registers (S, P and O of its rows), by the number of consumers: three
# warp groups and the producer warp share the register file at 160 each (FlashAttention-3's split at D 64)
CONSUMER_REGS = {2: 240, 3: 160}


def pingpong_tile(head_dim: int, dtype=torch.bfloat16) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, STAGES, num_warps) of the ping-pong variant: the program's rows and its
    consumers' warps, two warp groups (three with 12 warps run, and FlashAttention-3's D 64 tile of three
    measured no faster on the H200). At D 128 keys of 128 with three stages, measured fastest under triton
    3.6 and 3.9 (benchmarks/NOTES.md). FP8 tiles (half the bytes): keys of 128 at D 64 and 128, the
    fastest of those ``tools/probe.py gluon_tiles_fp8`` times, or close to it, at three of its four shapes
    (benchmarks/NOTES.md; the config table says which FP8 keys run here)."""
    if dtype == torch.float8_e4m3fn:
        return {64: (128, 128, 3, 8), 128: (128, 128, 3, 8)}[head_dim]
    return {64: (128, 128, 3, 8), 128: (128, 128, 3, 8), 256: (128, 64, 2, 8)}[head_dim]


