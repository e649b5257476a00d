"""The Hopper (sm_90) backward in Gluon: the ``tl`` backward's two passes with warp-group MMAs and TMA.

The same algorithm and result contract as ``impl_triton.kernels``' ``_attn_bwd_dq`` and
``_attn_bwd_dkdv`` (deterministic: no atomics; dQ in a pass of its own that also stores delta, then
dK and dV summed over a K/V head's query heads in one program), written at the warp-group level as the
forward (``impl_triton.gluon_attention``): Q, dO, K and V tiles copied by TMA through a ring of
shared-memory slots completing on mbarriers, every product an asynchronous ``warpgroup_mma`` (the
probabilities and dS passed in registers), the results written by TMA.

- ``_gluon_bwd_dq``: one (batch, head, BLOCK_M rows) program. delta = rowsum(dO * O) - dlse stored
  for the second pass; over the key tiles the row sees, S = Q K^T and dP = dO V^T issued together,
  p = exp2(S * scale * log2(e) - m2) (m2 = lse * log2(e); +inf for a row with no key: p = 0),
  dS = p * (dP - delta), dQ += dS K, that last product issued behind the next tile's S and dP.
- ``_gluon_bwd_dkdv``: one (batch, K/V head, BLOCK_N keys) program over the row blocks of each query
  head of its group that see those keys: S^T = K Q^T and dP^T = V dO^T, p^T, dV += p^T dO,
  dS^T = p^T * (dP^T - delta), dK += dS^T Q; with OVERLAP, dV's and dK's products are issued around
  the next tile's S^T and dP^T (FlashAttention-3's overlap inside a warp group, as the forward's).
- ``_gluon_bwd_fused`` (the one-pass scheme, not deterministic): the dK/dV program also adds each row
  tile's dS K into a float32 dQ sum, by atomics or (triton >= 3.9) the copy engine's bulk reduce-add;
  ``_gluon_bwd_ws`` is it with FlashAttention-3's warp roles (a loader warp, a dQ warp, the consumers).

The products accumulate in the same order either way: the gradients do not depend on the overlap.

Rows past Lq and keys past Lk need no mask: TMA reads them as zeros, a row past Lq gets lse = +inf
(p = 0), and a key past Lk only meets a zero row of K (dQ) or gives rows of dK and dV that are not
written. Causal tiles that cross the diagonal are masked (either alignment: row i sees key j iff
j <= i + causal_shift).

It serves what the forward's Gluon kernel serves, less the head dim 256: float16 or bfloat16,
D = Dv in {64, 128}, causal or not, grouped-query heads, an optional dlse; TMA-ready tensors.

The Triton backend's backward takes the warp-specialised one pass, each row tile's stats read from shared memory,
where ``one_pass`` says (``backward_plan``): triton >= 3.9 (the bulk reduce-add) with a CUDA 13 ptxas, sm_90,
D 64 and 128 from 1024 rows and keys and the Gluon forward's size guard, no call or setting asking for a
deterministic backward: where it timed faster than the tl backward (benchmarks/NOTES.md). Everything else, and
every deterministic backward, stays on the tl kernels: the two passes here and the one pass with dQ by atomics
timed slower than them; ``backward`` and ``backward_fused`` are called by the GPU tests and ``tools/probe.py
gluon_bwd``.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import _core as _gl_core
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from common.interpret import apply_interpreter_fixes
from common.launch import COMPILE_OPTIONS, BoundSlots, CachedLauncher, alignment
from common.plan import MAX_GRID_AXIS, BackwardPlan
from impl_triton.gluon_attention import (
    LOG2E,
    _barriers,
    _invalidate,
    _key_tiles,
    _program,
    _rebased,
    _runner_constexprs,
    _tma_load,
    _tma_ready,
    _tma_store,
    _whole_tiles,
    gluon_switch,
    large_enough,
    launch_kept,
)
from impl_triton.gluon_attention import descriptor as _descriptor
from impl_triton.kernels import _one_pass_epilogue, _one_pass_prologue

HEAD_DIMS = (64, 128)
# (a barrier of the CTA's threads: triton 3.6 names it thread_barrier, later versions barrier)
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# The copy engine's bulk reduce-add of a shared tile into global memory: triton 3.9's, None under 3.6 (a
# name a kernel reaches through a module attribute must exist there even in a branch never compiled).
_bulk_reduce_add = getattr(tma, "async_atomic_add", None)
WORKER_REGS = gl.constexpr(24)  # the warp-specialised one pass's loader and dQ warps hold no tile


@_gl_core.builtin
def _own_mma_wait(num_outstanding, deps, own=True, _semantic=None):
    """``warpgroup_mma_wait``, for this warp group's products alone where ``own``. Triton 3.9 follows a wait in a
    partition of two warp groups with a barrier of all its warps (the other group's products may still read a
    shared operand that a later write would change), unless the wait is marked ``warpGroupLocal``; a caller whose
    shared-memory reuse is already ordered (by a barrier of its own or by mbarriers) marks it so. Triton 3.6 has
    no such barrier, and the mark does nothing there."""
    results = warpgroup_mma_wait(num_outstanding, deps, _semantic=_semantic)
    if _gl_core._unwrap_if_constexpr(own):
        first = results[0] if isinstance(results, tuple) else results
        first.handle.set_attr("warpGroupLocal", _semantic.builder.get_unit_attr())
    return results


@gluon.jit
def _dq_ds(qk, dp, newer: gl.constexpr, m2, delta, qk_scale, offs_m, j, whole, causal_shift, BLOCK_N: gl.constexpr,
           IS_CAUSAL: gl.constexpr, col_s: gl.constexpr, ds_layout: gl.constexpr, dtype: gl.constexpr):
    """dS of key tile j as dQ's A operand (``dtype``), from its S and dP in flight (``newer``: the
    groups issued since S, dP's the first): p waits for S alone, dS for dP."""
    qk = warpgroup_mma_wait(num_outstanding=newer, deps=(qk, ))
    p = gl.exp2(qk * qk_scale - m2[:, None])
    if IS_CAUSAL and j >= whole:  # (keys past Lk need no mask: they meet zero rows of K)
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_s)
        p = gl.where(offs_n[None, :] <= offs_m[:, None] + causal_shift, p, 0.0)
    dp = warpgroup_mma_wait(num_outstanding=newer - 1, deps=(dp, ))
    return gl.convert_layout((p * (dp - delta[:, None])).to(dtype), ds_layout)


@gluon.jit
def _gluon_bwd_dq(
    q_desc, k_desc, v_desc, do_desc, dq_desc, O, LSE, DLSE, DELTA,
    stride_oz, stride_oh, stride_om, stride_lz, stride_lh, stride_lm, stride_dlz, stride_dlh, stride_dlm,
    scale, H, GROUP, Lq, Lk, causal_shift,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, WITH_DLSE: gl.constexpr, num_warps: gl.constexpr,
):
    """dQ of BLOCK_M rows of one (batch, head), and their delta stored to DELTA (B·H, Lq) (see the
    module docstring). Descriptors over (B, H, L, D) tensors: q, do and dq with (1, 1, BLOCK_M, D)
    blocks, k and v (B, H_kv, Lk, D) with (1, 1, BLOCK_N, D)."""
    dtype: gl.constexpr = q_desc.dtype
    start_m, off_hz, off_z, off_h, off_h_kv = _program(H, GROUP)
    row_start = start_m * BLOCK_M
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    q_smem, do_smem, k_smem, v_smem, q_bars, kv_bars = _resident_and_ring(q_desc, do_desc, k_desc, v_desc, BLOCK_M,
                                                                          BLOCK_N, HEAD_DIM, STAGES)
    q_bar = q_bars.index(0)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    _tma_load(q_desc, [off_z, off_h, row_start, 0], q_bar, q_smem)
    _tma_load(do_desc, [off_z, off_h, row_start, 0], q_bar, do_smem)
    n_tiles = _key_tiles(Lk, start_m, causal_shift, BLOCK_M, BLOCK_N, IS_CAUSAL)
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
    for s in gl.static_range(STAGES):  # the ring's first tiles in flight
        if s < n_tiles:
            mbarrier.expect(kv_bars.index(s), kv_bytes)
            _tma_load(k_desc, [off_z, off_h_kv, s * BLOCK_N, 0], kv_bars.index(s), k_smem.index(s))
            _tma_load(v_desc, [off_z, off_h_kv, s * BLOCK_N, 0], kv_bars.index(s), v_smem.index(s))

    # delta = rowsum(dO * O) - dlse, this program's rows (O read directly, dO from its tile)
    rows_b = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout))
    cols_b = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_layout))
    o = gl.load(O + off_z.to(gl.int64) * stride_oz + off_h.to(gl.int64) * stride_oh
                + rows_b.to(gl.int64)[:, None] * stride_om + cols_b[None, :], mask=rows_b[:, None] < Lq, other=0.0)
    mbarrier.wait(q_bar, 0)
    do_tile = do_smem.reshape([BLOCK_M, HEAD_DIM])
    delta = gl.sum(o.to(gl.float32) * do_tile.load(rows_layout).to(gl.float32), 1)
    if WITH_DLSE:
        delta -= gl.load(DLSE + off_z.to(gl.int64) * stride_dlz + off_h.to(gl.int64) * stride_dlh
                         + rows_b.to(gl.int64) * stride_dlm, mask=rows_b < Lq, other=0.0)
    gl.store(DELTA + off_hz.to(gl.int64) * Lq + rows_b, delta, mask=rows_b < Lq)
    delta = gl.convert_layout(delta, row_s)
    offs_m = row_start + gl.arange(0, BLOCK_M, layout=row_s)
    lse = gl.load(LSE + off_z.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
                  + offs_m.to(gl.int64) * stride_lm, mask=offs_m < Lq, other=float("inf"))
    # p = exp2(s * scale * log2(e) - m2); a row with no visible key (lse = -inf) gets m2 = +inf, so
    # its p is 0 (SDPA's math backend: zero gradient)
    m2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    qk_scale = scale * LOG2E
    whole = _whole_tiles(Lk, row_start, causal_shift, BLOCK_N, IS_CAUSAL)
    q = q_smem.reshape([BLOCK_M, HEAD_DIM])
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    # Tile j's S and dP are issued before dQ's product of tile j - 1 (dS of tile j - 1 carried in
    # registers), so the tensor cores run those three while the warps wait for S alone, then compute
    # P under dP's product and dS under dQ's (``_dq_ds``); a slot is refilled once dQ's product of its
    # tile is in. Tile 0 has no product before it.
    if n_tiles > 0:
        mbarrier.wait(kv_bars.index(0), 0)
        qk = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s, use_acc=False,
                           is_async=True)
        dp = warpgroup_mma(do_tile, v_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                           use_acc=False, is_async=True)
        ds = _dq_ds(qk, dp, 1, m2, delta, qk_scale, offs_m, 0, whole, causal_shift, BLOCK_N, IS_CAUSAL, col_s,
                    ds_layout, dtype)
        for j in range(1, n_tiles):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(kv_bars.index(slot), (j // STAGES) & 1)
            qk = warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                               use_acc=False, is_async=True)
            dp = warpgroup_mma(do_tile, v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                               use_acc=False, is_async=True)
            dq = warpgroup_mma(ds, k_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
            ds = _dq_ds(qk, dp, 2, m2, delta, qk_scale, offs_m, j, whole, causal_shift, BLOCK_N, IS_CAUSAL, col_s,
                        ds_layout, dtype)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            refill = j - 1 + STAGES
            if refill < n_tiles:  # (tile j - 1's slot, read by its three products)
                mbarrier.expect(kv_bars.index(prev), kv_bytes)
                _tma_load(k_desc, [off_z, off_h_kv, refill * BLOCK_N, 0], kv_bars.index(prev), k_smem.index(prev))
                _tma_load(v_desc, [off_z, off_h_kv, refill * BLOCK_N, 0], kv_bars.index(prev), v_smem.index(prev))
        last = (n_tiles - 1) % STAGES
        dq = warpgroup_mma(ds, k_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))

    # dQ leaves by TMA through Q's shared tile (every product that read Q is complete), clipped at Lq
    q_smem.reshape([BLOCK_M, HEAD_DIM]).store((dq * scale).to(dtype))
    fence_async_shared()
    _tma_store(dq_desc, [off_z, off_h, row_start, 0], q_smem)
    tma.store_wait(0)
    _invalidate(q_bars, 1)
    _invalidate(kv_bars, STAGES)


@gluon.jit
def _dkdv_rows(LSE, DELTA, stride_lz, stride_lh, stride_lm, off_z, off_h_kv, H_KV, GROUP, lo, row_blocks, t, Lq,
               BLOCK_M: gl.constexpr, row_st: gl.constexpr):
    """Row tile t of a dK/dV program (query head t // row_blocks of the group, row block lo + t %
    row_blocks): its block, rows, m2 = lse * log2(e) (+inf for a row past Lq or with no key: p = 0)
    and delta."""
    off_h = off_h_kv * GROUP + t // row_blocks
    block = lo + t % row_blocks
    offs_m = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_st)
    head = off_z.to(gl.int64) * H_KV * GROUP + off_h  # (in B·H: DELTA's rows)
    lse = gl.load(LSE + off_z.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
                  + offs_m.to(gl.int64) * stride_lm, mask=offs_m < Lq, other=float("inf"))
    delta = gl.load(DELTA + head * Lq + offs_m, mask=offs_m < Lq, other=0.0)
    m2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    return block, offs_m, m2, delta


@gluon.jit
def _dkdv_p_ds(qkT, dpT, newer: gl.constexpr, m2, delta, qk_scale, offs_kn, offs_m, block, full_lo, causal_shift,
               IS_CAUSAL: gl.constexpr, op_layout: gl.constexpr, dtype: gl.constexpr):
    """p^T and dS^T of a row tile as dV's and dK's A operands (``dtype``), from its S^T and dP^T in
    flight (``newer``: the groups issued since S^T, dP^T's the first): p^T waits for S^T alone, dS^T
    for dP^T. Causal row blocks before ``full_lo`` cross the diagonal: masked."""
    qkT = warpgroup_mma_wait(num_outstanding=newer, deps=(qkT, ))
    p = gl.exp2(qkT * qk_scale - m2[None, :])
    if IS_CAUSAL and block < full_lo:
        p = gl.where(offs_kn[:, None] <= offs_m[None, :] + causal_shift, p, 0.0)
    dpT = warpgroup_mma_wait(num_outstanding=newer - 1, deps=(dpT, ))
    pT = gl.convert_layout(p.to(dtype), op_layout)
    return pT, gl.convert_layout((p * (dpT - delta[None, :])).to(dtype), op_layout)


@gluon.jit
def _load_row_tile(q_desc, do_desc, q_bars, q_smem, do_smem, slot, off_z, off_h_kv, GROUP, lo, row_blocks, t,
                   BLOCK_M: gl.constexpr):
    """Q and dO of row tile t of a key block's program (query head t // row_blocks of the group, row block
    lo + t % row_blocks) by TMA into ring slot ``slot``, completing on its barrier."""
    off_h = off_h_kv * GROUP + t // row_blocks
    row = (lo + t % row_blocks) * BLOCK_M
    mbarrier.expect(q_bars.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    _tma_load(q_desc, [off_z, off_h, row, 0], q_bars.index(slot), q_smem.index(slot))
    _tma_load(do_desc, [off_z, off_h, row, 0], q_bars.index(slot), do_smem.index(slot))


@gluon.jit
def _resident_and_ring(a_desc, b_desc, c_desc, d_desc, A_ROWS: gl.constexpr, C_ROWS: gl.constexpr,
                       HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Both passes' shared buffers: one tile each of a and b (the program's own rows: Q and dO in the
    dQ pass, K and V in a key block's) on one mbarrier, and a ring of STAGES slots of c and d (the
    tiles it walks) with a barrier each. Returns (a_smem, b_smem, c_smem, d_smem, ab_bars, cd_bars)."""
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [1, 1, A_ROWS, HEAD_DIM], a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [1, 1, A_ROWS, HEAD_DIM], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, C_ROWS, HEAD_DIM], c_desc.layout)
    d_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, C_ROWS, HEAD_DIM], d_desc.layout)
    ab_bars = _barriers(1, 1)
    cd_bars = _barriers(STAGES, 1)
    fence_async_shared()
    return a_smem, b_smem, c_smem, d_smem, ab_bars, cd_bars


@gluon.jit
def _key_block_start(q_desc, k_desc, v_desc, do_desc, off_z, off_h_kv, key_start, GROUP, Lq, causal_shift,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                     IS_CAUSAL: gl.constexpr, PRELOAD: gl.constexpr):
    """A key block's program (the dK/dV pass, the one-pass backward) starts: its shared buffers (K and V
    tiles, a ring of STAGES Q and dO row tiles, their barriers), its K and V tiles by TMA, the row blocks
    that see its keys (causal: from the first row at or past key_start - causal_shift; those before
    ``full_lo`` cross the diagonal: masked; the rest see every key here) and, PRELOAD, the ring's first row
    tiles in flight (else a loader warp fills the ring). Returns (k_smem, v_smem, q_smem, do_smem, kv_bars,
    q_bars, lo, full_lo, row_blocks, n_tiles)."""
    k_smem, v_smem, q_smem, do_smem, kv_bars, q_bars = _resident_and_ring(k_desc, v_desc, q_desc, do_desc, BLOCK_N,
                                                                          BLOCK_M, HEAD_DIM, STAGES)
    kv_bar = kv_bars.index(0)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [off_z, off_h_kv, key_start, 0], kv_bar, k_smem)
    _tma_load(v_desc, [off_z, off_h_kv, key_start, 0], kv_bar, v_smem)
    lo = 0
    full_lo = 0
    if IS_CAUSAL:
        lo = gl.maximum(key_start - causal_shift, 0) // BLOCK_M
        full_lo = gl.maximum(gl.cdiv(key_start + BLOCK_N - 1 - causal_shift, BLOCK_M), lo)
    row_blocks = gl.maximum(gl.cdiv(Lq, BLOCK_M) - lo, 0)
    n_tiles = GROUP * row_blocks
    for s in gl.static_range(STAGES if PRELOAD else 0):
        if s < n_tiles:
            _load_row_tile(q_desc, do_desc, q_bars, q_smem, do_smem, s, off_z, off_h_kv, GROUP, lo, row_blocks, s,
                           BLOCK_M)
    return k_smem, v_smem, q_smem, do_smem, kv_bars, q_bars, lo, full_lo, row_blocks, n_tiles


@gluon.jit
def _key_block_resident(scale, key_start, k_smem, v_smem, kv_bar, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        HEAD_DIM: gl.constexpr, st_layout: gl.constexpr, acc_layout: gl.constexpr):
    """What a key block's program holds across its row tiles, once its K and V tiles are in (waited for
    here): (qk_scale, its keys' indices, S^T's zero, dK's and dV's zeroed float32 accumulators, K and V as
    BLOCK_N x HEAD_DIM tiles)."""
    qk_scale = scale * LOG2E
    offs_kn = key_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, 0)
    return qk_scale, offs_kn, zero_st, dk, dv, k_smem.reshape([BLOCK_N, HEAD_DIM]), v_smem.reshape([BLOCK_N, HEAD_DIM])


@gluon.jit
def _store_dk_dv(dk, dv, scale, dk_desc, dv_desc, k_smem, v_smem, off_z, off_h_kv, key_start, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr):
    """dK (scaled) and dV leave by TMA through K's and V's shared tiles (every product that read them is
    complete), clipped at Lk."""
    dtype: gl.constexpr = k_smem.dtype
    k_smem.reshape([BLOCK_N, HEAD_DIM]).store((dk * scale).to(dtype))
    v_smem.reshape([BLOCK_N, HEAD_DIM]).store(dv.to(dtype))
    fence_async_shared()
    _tma_store(dk_desc, [off_z, off_h_kv, key_start, 0], k_smem)
    _tma_store(dv_desc, [off_z, off_h_kv, key_start, 0], v_smem)
    tma.store_wait(0)


@gluon.jit
def _key_block_finish(dk, dv, scale, dk_desc, dv_desc, k_smem, v_smem, kv_bars, q_bars, off_z, off_h_kv, key_start,
                      BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """``_store_dk_dv``, then the key block's barriers invalidated."""
    _store_dk_dv(dk, dv, scale, dk_desc, dv_desc, k_smem, v_smem, off_z, off_h_kv, key_start, BLOCK_N, HEAD_DIM)
    _invalidate(kv_bars, 1)
    _invalidate(q_bars, STAGES)


@gluon.jit
def _dkdv_tile(k, v, q_tile, do_tile, dk, dv, zero_st, m2, delta, qk_scale, offs_kn, offs_m, block, full_lo,
               causal_shift, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr,
               op_layout: gl.constexpr, ISSUE_DK: gl.constexpr, OWN_WAITS: gl.constexpr = False,
               STATS_SMEM: gl.constexpr = False):
    """One row tile of a key block, each product after the one before (no overlap with the next tile):
    S^T and dP^T issued together, p^T under dP^T's product, dV's product issued, dS^T, dK's product
    issued (unless not ISSUE_DK: the caller issues it). Returns (dk, dv) in flight and dS^T (the inputs'
    dtype). OWN_WAITS: its two waits are each warp group's own (``_own_mma_wait``): nothing here writes
    shared memory, and the caller orders its next writes. STATS_SMEM: m2 and delta are shared-memory rows,
    read into S^T's columns where each is used (not held across the tile's products)."""
    dtype: gl.constexpr = k.dtype
    q = q_tile.reshape([BLOCK_M, HEAD_DIM])
    do = do_tile.reshape([BLOCK_M, HEAD_DIM])
    qkT = warpgroup_mma(k, q.permute((1, 0)), zero_st, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v, do.permute((1, 0)), zero_st, use_acc=False, is_async=True)
    qkT = _own_mma_wait(1, (qkT, ), OWN_WAITS)
    if STATS_SMEM:
        m2 = m2.load(gl.SliceLayout(0, zero_st.type.layout))
    pT = gl.exp2(qkT * qk_scale - m2[None, :])
    if IS_CAUSAL and block < full_lo:
        pT = gl.where(offs_kn[:, None] <= offs_m[None, :] + causal_shift, pT, 0.0)
    dv = warpgroup_mma(gl.convert_layout(pT.to(dtype), op_layout), do, dv, is_async=True)
    dpT = _own_mma_wait(1, (dpT, ), OWN_WAITS)
    if STATS_SMEM:
        delta = delta.load(gl.SliceLayout(0, zero_st.type.layout))
    dsT = (pT * (dpT - delta[None, :])).to(dtype)
    if ISSUE_DK:
        dk = warpgroup_mma(gl.convert_layout(dsT, op_layout), q, dk, is_async=True)
    return dk, dv, dsT


@gluon.jit
def _gluon_bwd_dkdv(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA,
    stride_lz, stride_lh, stride_lm,
    scale, H_KV, GROUP, Lq, Lk, causal_shift,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr,
):
    """dK and dV of BLOCK_N keys of one (batch, K/V head), summed over its GROUP query heads (see the
    module docstring). Descriptors: k, v, dk, dv over (B, H_kv, Lk, D) with (1, 1, BLOCK_N, D)
    blocks; q and do over (B, H, Lq, D) with (1, 1, BLOCK_M, D). The Q and dO tiles stream through a
    ring of STAGES slots, tile t being query head t // row_blocks of the group, row block lo + t %
    row_blocks."""
    dtype: gl.constexpr = q_desc.dtype
    start_n = gl.program_id(0)
    off_hz = gl.program_id(1)
    off_z = off_hz // H_KV
    off_h_kv = off_hz % H_KV
    key_start = start_n * BLOCK_N
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_st: gl.constexpr = gl.SliceLayout(0, st_layout)

    k_smem, v_smem, q_smem, do_smem, kv_bars, q_bars, lo, full_lo, row_blocks, n_tiles = _key_block_start(
        q_desc, k_desc, v_desc, do_desc, off_z, off_h_kv, key_start, GROUP, Lq, causal_shift, BLOCK_M, BLOCK_N,
        HEAD_DIM, STAGES, IS_CAUSAL, True)
    kv_bar = kv_bars.index(0)

    qk_scale, offs_kn, zero_st, dk, dv, k, v = _key_block_resident(scale, key_start, k_smem, v_smem, kv_bar, BLOCK_M,
                                                                   BLOCK_N, HEAD_DIM, st_layout, acc_layout)
    # Tile t's S^T and dP^T are issued before dV's and dK's products of tile t - 1 (its p^T and dS^T
    # carried in registers), so the tensor cores run all four while the warps wait for S^T alone, then
    # compute p^T under dP^T's product and dS^T under dV's and dK's (``_dkdv_p_ds``); a slot is refilled
    # once both products of its tile are in. Tile 0 has no product before it. OVERLAP off: each tile's
    # four products complete before the next tile's are issued (fewer registers live: at D 128 the
    # overlap spills).
    if OVERLAP and n_tiles > 0:
        block, offs_m, m2, delta = _dkdv_rows(LSE, DELTA, stride_lz, stride_lh, stride_lm, off_z, off_h_kv, H_KV,
                                              GROUP, lo, row_blocks, 0, Lq, BLOCK_M, row_st)
        mbarrier.wait(q_bars.index(0), 0)
        qkT = warpgroup_mma(k, q_smem.index(0).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_st,
                            use_acc=False, is_async=True)
        dpT = warpgroup_mma(v, do_smem.index(0).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_st,
                            use_acc=False, is_async=True)
        pT, dsT = _dkdv_p_ds(qkT, dpT, 1, m2, delta, qk_scale, offs_kn, offs_m, block, full_lo, causal_shift,
                             IS_CAUSAL, op_layout, dtype)
        for t in range(1, n_tiles):
            slot = t % STAGES
            prev = (t - 1) % STAGES
            block, offs_m, m2, delta = _dkdv_rows(LSE, DELTA, stride_lz, stride_lh, stride_lm, off_z, off_h_kv, H_KV,
                                                  GROUP, lo, row_blocks, t, Lq, BLOCK_M, row_st)
            mbarrier.wait(q_bars.index(slot), (t // STAGES) & 1)
            dv = warpgroup_mma(pT, do_smem.index(prev).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
            qkT = warpgroup_mma(k, q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_st,
                                use_acc=False, is_async=True)
            dpT = warpgroup_mma(v, do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_st,
                                use_acc=False, is_async=True)
            dk = warpgroup_mma(dsT, q_smem.index(prev).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
            pT, dsT = _dkdv_p_ds(qkT, dpT, 2, m2, delta, qk_scale, offs_kn, offs_m, block, full_lo, causal_shift,
                                 IS_CAUSAL, op_layout, dtype)
            dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
            refill = t - 1 + STAGES
            if refill < n_tiles:  # (tile t - 1's slot, read by its four products)
                _load_row_tile(q_desc, do_desc, q_bars, q_smem, do_smem, prev, off_z, off_h_kv, GROUP, lo, row_blocks,
                               refill, BLOCK_M)
        last = (n_tiles - 1) % STAGES
        dv = warpgroup_mma(pT, do_smem.index(last).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
        dk = warpgroup_mma(dsT, q_smem.index(last).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    elif not OVERLAP:
        for t in range(n_tiles):
            slot = t % STAGES
            block, offs_m, m2, delta = _dkdv_rows(LSE, DELTA, stride_lz, stride_lh, stride_lm, off_z, off_h_kv, H_KV,
                                                  GROUP, lo, row_blocks, t, Lq, BLOCK_M, row_st)
            mbarrier.wait(q_bars.index(slot), (t // STAGES) & 1)
            dk, dv, _ = _dkdv_tile(k, v, q_smem.index(slot), do_smem.index(slot), dk, dv, zero_st, m2, delta,
                                   qk_scale, offs_kn, offs_m, block, full_lo, causal_shift, BLOCK_M, HEAD_DIM,
                                   IS_CAUSAL, op_layout, True)
            dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
            refill = t + STAGES
            if refill < n_tiles:  # (slot's tiles read by all four products)
                _load_row_tile(q_desc, do_desc, q_bars, q_smem, do_smem, slot, off_z, off_h_kv, GROUP, lo, row_blocks,
                               refill, BLOCK_M)

    _key_block_finish(dk, dv, scale, dk_desc, dv_desc, k_smem, v_smem, kv_bars, q_bars, off_z, off_h_kv, key_start,
                      BLOCK_N, HEAD_DIM, STAGES)


@gluon.constexpr_function
def _one_pass_layouts(BLOCK_M, BLOCK_N, HEAD_DIM, WARPS, DQ_T):
    """The one pass's register layouts, the plain and the warp-specialised kernel's: (S^T's and dP^T's, BLOCK_N x
    BLOCK_M; dK's and dV's accumulators; dQ's: with DQ_T dQ^T, HEAD_DIM x BLOCK_M, rows over all the warps, else
    BLOCK_M x HEAD_DIM, columns over the warp groups; p^T's and dS^T's as the A operand of dV's and dK's
    products)."""
    st = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_M, 16])
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD_DIM, 16])
    if DQ_T:
        dq = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_M, 16])
    else:
        groups = WARPS // 4
        dq = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups],
                                       instr_shape=[16, HEAD_DIM // groups, 16])
    return st, acc, dq, gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)


@gluon.jit
def _gluon_bwd_fused(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, DQ, dq_desc, LSE, DELTA,
    stride_dqz, stride_dqh, stride_dqm, stride_lz, stride_lh, stride_lm,
    scale, H_KV, GROUP, Lq, Lk, causal_shift,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, DQ_T: gl.constexpr, DQ_TMA: gl.constexpr, DQ_FIRST: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``_gluon_bwd_dkdv``'s program (dK and dV of BLOCK_N keys, summed over the group's query heads)
    that also adds each row tile's share of dQ, dS K, into DQ (float32 (B, H, Lq, D), zeroed by the
    caller; its unscaled sum): five products a tile pair where the two passes take seven
    (FlashAttention-2's and -3's scheme). dS^T goes through shared memory: read transposed as dS K's A
    operand, the product split over the warp groups by columns; or, DQ_T, as the B operand of
    dQ^T = K^T dS^T (K read transposed), whose rows are the head dim: row tiles narrower than a warp
    group's 64 (fewer registers at D 128). The tile is added by per-element float32 atomics, or, DQ_TMA
    (triton >= 3.9's ``hopper.tma.async_atomic_add``), staged in shared memory and added by the copy
    engine's bulk reduce-add through ``dq_desc`` (DQ's descriptor), clipped at Lq, while the program
    goes on to the next tile (two staging buffers: FlashAttention-3 adds dQ so, from a warp of its
    own). DQ_FIRST: dK's product is issued after dQ's, so that dQ's tile goes out while dK's product runs
    (waited for at the tile's end: every warp group's, once past the next tile's first barrier, where the
    tile's slot is refilled).
    The order of dQ's additions is the GPU's: dQ is not bitwise reproducible from run to run."""
    dtype: gl.constexpr = q_desc.dtype
    start_n = gl.program_id(0)
    off_hz = gl.program_id(1)
    off_z = off_hz // H_KV
    off_h_kv = off_hz % H_KV
    key_start = start_n * BLOCK_N
    layouts: gl.constexpr = _one_pass_layouts(BLOCK_M, BLOCK_N, HEAD_DIM, num_warps, DQ_T)
    st_layout: gl.constexpr = layouts[0]
    acc_layout: gl.constexpr = layouts[1]
    dq_layout: gl.constexpr = layouts[2]
    op_layout: gl.constexpr = layouts[3]
    ds_shared: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, BLOCK_M * 2), element_bitwidth=16,
                                                   rank=2)
    row_st: gl.constexpr = gl.SliceLayout(0, st_layout)

    k_smem, v_smem, q_smem, do_smem, kv_bars, q_bars, lo, full_lo, row_blocks, n_tiles = _key_block_start(
        q_desc, k_desc, v_desc, do_desc, off_z, off_h_kv, key_start, GROUP, Lq, causal_shift, BLOCK_M, BLOCK_N,
        HEAD_DIM, STAGES, IS_CAUSAL, True)
    kv_bar = kv_bars.index(0)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_shared)
    if DQ_TMA:  # (two: a tile's bulk add reads one while the next tile's dQ is written to the other)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, HEAD_DIM], dq_desc.layout)

    if DQ_T:
        zero_dq = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, layout=dq_layout)
        dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, dq_layout))
        dq_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, dq_layout))
    else:
        zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
        dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
        dq_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    qk_scale, offs_kn, zero_st, dk, dv, k, v = _key_block_resident(scale, key_start, k_smem, v_smem, kv_bar, BLOCK_M,
                                                                   BLOCK_N, HEAD_DIM, st_layout, acc_layout)
    for t in range(n_tiles):
        slot = t % STAGES
        block, offs_m, m2, delta = _dkdv_rows(LSE, DELTA, stride_lz, stride_lh, stride_lm, off_z, off_h_kv, H_KV,
                                              GROUP, lo, row_blocks, t, Lq, BLOCK_M, row_st)
        mbarrier.wait(q_bars.index(slot), (t // STAGES) & 1)
        dk, dv, dsT = _dkdv_tile(k, v, q_smem.index(slot), do_smem.index(slot), dk, dv, zero_st, m2, delta, qk_scale,
                                 offs_kn, offs_m, block, full_lo, causal_shift, BLOCK_M, HEAD_DIM, IS_CAUSAL, op_layout,
                                 not DQ_FIRST, True)
        # dS^T to shared memory for dQ's product (every warp's rows of it before any warp group reads)
        ds_smem.store(dsT)
        fence_async_shared()
        _cta_barrier()
        if DQ_FIRST:  # (past the barrier every warp group has S^T of this tile: the last tile's products are done)
            refill = t - 1 + STAGES
            if t > 0 and refill < n_tiles:
                _load_row_tile(q_desc, do_desc, q_bars, q_smem, do_smem, (t - 1) % STAGES, off_z, off_h_kv, GROUP, lo,
                               row_blocks, refill, BLOCK_M)
        if DQ_T:
            dq = warpgroup_mma(k.permute((1, 0)), ds_smem, zero_dq, use_acc=False, is_async=True)
        else:
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k, zero_dq, use_acc=False, is_async=True)
        if DQ_FIRST:
            dk = warpgroup_mma(gl.convert_layout(dsT, op_layout), q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM]), dk,
                               is_async=True)
            dv, dq = _own_mma_wait(1, (dv, dq))
        else:
            dk, dv, dq = _own_mma_wait(0, (dk, dv, dq))
        if DQ_TMA:  # (the bulk add of two tiles ago, which read this tile's staging buffer, is done)
            tma.store_wait(1)
        # (every warp group's dQ product has read dS^T before the next tile's is stored; with DQ_TMA, the
        # issuing thread's wait above is every thread's)
        _cta_barrier()
        off_h = off_h_kv * GROUP + t // row_blocks
        if DQ_TMA:
            staged = dq_smem.index(t % 2)
            if DQ_T:
                staged.reshape([BLOCK_M, HEAD_DIM]).store(gl.permute(dq, (1, 0)))
            else:
                staged.reshape([BLOCK_M, HEAD_DIM]).store(dq)
            fence_async_shared()
            _cta_barrier()
            _bulk_reduce_add(dq_desc, [off_z, off_h, block * BLOCK_M, 0], staged)
        else:
            rows = block * BLOCK_M + dq_rows
            base = DQ + off_z.to(gl.int64) * stride_dqz + off_h.to(gl.int64) * stride_dqh
            if DQ_T:
                gl.atomic_add(base + rows.to(gl.int64)[None, :] * stride_dqm + dq_cols[:, None], dq,
                              mask=rows[None, :] < Lq, sem="relaxed")
            else:
                gl.atomic_add(base + rows.to(gl.int64)[:, None] * stride_dqm + dq_cols[None, :], dq,
                              mask=rows[:, None] < Lq, sem="relaxed")
        if DQ_FIRST:  # (dK's product ran under dQ's addition)
            dk = _own_mma_wait(0, (dk, ))
        else:
            refill = t + STAGES
            if refill < n_tiles:  # (slot's tiles read by all five products)
                _load_row_tile(q_desc, do_desc, q_bars, q_smem, do_smem, slot, off_z, off_h_kv, GROUP, lo, row_blocks,
                               refill, BLOCK_M)

    _key_block_finish(dk, dv, scale, dk_desc, dv_desc, k_smem, v_smem, kv_bars, q_bars, off_z, off_h_kv, key_start,
                      BLOCK_N, HEAD_DIM, STAGES)


@gluon.jit
def _ws_loader(q_desc, do_desc, q_smem, do_smem, q_ready, q_empty, off_z, off_h_kv, GROUP, lo, row_blocks, n_tiles,
               LSE, DELTA, stride_lz, stride_lh, stride_lm, H_KV, Lq, stats_smem, BLOCK_M: gl.constexpr,
               STAGES: gl.constexpr, STATS_SMEM: gl.constexpr):
    """The warp-specialised one pass's loader warp: row tile t's Q and dO into ring slot t % STAGES once the
    consumers gave back its tile t - STAGES (``q_empty``; the ring's first round passes on fresh barriers);
    STATS_SMEM: its m2 and delta into the slot's rows of ``stats_smem`` first, ordered before the slot's
    barrier completes (the warp's barrier, then the arrival that expects Q's and dO's bytes)."""
    few: gl.constexpr = gl.BlockedLayout([max(BLOCK_M // 32, 1)], [32], [1], [0])
    for t in range(n_tiles):
        slot = t % STAGES
        mbarrier.wait(q_empty.index(slot), ((t // STAGES) & 1) ^ 1)
        if STATS_SMEM:
            _, _, m2, delta = _dkdv_rows(LSE, DELTA, stride_lz, stride_lh, stride_lm, off_z, off_h_kv, H_KV, GROUP, lo,
                                         row_blocks, t, Lq, BLOCK_M, few)
            stats_smem.index(2 * slot).store(m2)
            stats_smem.index(2 * slot + 1).store(delta)
            _cta_barrier()
        _load_row_tile(q_desc, do_desc, q_ready, q_smem, do_smem, slot, off_z, off_h_kv, GROUP, lo, row_blocks, t,
                       BLOCK_M)


@gluon.jit
def _ws_dq_writer(dq_desc, dq_smem, dq_ready, dq_empty, off_z, off_h_kv, GROUP, lo, row_blocks, n_tiles,
                  BLOCK_M: gl.constexpr):
    """The warp-specialised one pass's dQ warp (FlashAttention-3's): row tile t's dQ, staged by the consumers
    in buffer t % 2 (``dq_ready``), added into the float32 sum by the copy engine's bulk reduce-add; the
    buffer goes back (``dq_empty``) once the copy has read it."""
    for t in range(n_tiles):
        buf = t % 2
        mbarrier.wait(dq_ready.index(buf), (t // 2) & 1)
        off_h = off_h_kv * GROUP + t // row_blocks
        _bulk_reduce_add(dq_desc, [off_z, off_h, (lo + t % row_blocks) * BLOCK_M, 0], dq_smem.index(buf))
        tma.store_wait(0)
        mbarrier.arrive(dq_empty.index(buf), count=1)


@gluon.jit
def _ws_consumer(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, stats_smem, kv_bar, q_ready, q_empty, dq_ready,
                 dq_empty, dk_desc, dv_desc, LSE, DELTA, stride_lz, stride_lh, stride_lm, scale, H_KV, GROUP, Lq,
                 causal_shift, off_z, off_h_kv, key_start, lo, full_lo, row_blocks, n_tiles, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 DQ_T: gl.constexpr, WARPS: gl.constexpr, STATS_SMEM: gl.constexpr):
    """The warp-specialised one pass's consumer warps (``_gluon_bwd_fused``'s loop with DQ_FIRST, less its
    copies): per row tile the five products, dS^T through shared memory, dQ staged for the dQ warp while
    dK's product runs; the tile's ring slot and staging buffer handed over by mbarriers. Then dK and dV out
    by TMA. STATS_SMEM: each tile's m2 and delta are read where used from its ring slot's rows of ``stats_smem``
    (the loader warp's), so that no thread holds a copy for every column of S^T across the tile
    (FlashAttention-3's registers at 128 x 128)."""
    layouts: gl.constexpr = _one_pass_layouts(BLOCK_M, BLOCK_N, HEAD_DIM, WARPS, DQ_T)
    st_layout: gl.constexpr = layouts[0]
    acc_layout: gl.constexpr = layouts[1]
    dq_layout: gl.constexpr = layouts[2]
    op_layout: gl.constexpr = layouts[3]
    if DQ_T:
        zero_dq = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, layout=dq_layout)
    else:
        zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    qk_scale, offs_kn, zero_st, dk, dv, k, v = _key_block_resident(scale, key_start, k_smem, v_smem, kv_bar, BLOCK_M,
                                                                   BLOCK_N, HEAD_DIM, st_layout, acc_layout)
    for t in range(n_tiles):
        slot = t % STAGES
        buf = t % 2
        if STATS_SMEM:
            block = lo + t % row_blocks
            offs_m = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=cols)
            m2 = stats_smem.index(2 * slot)
            delta = stats_smem.index(2 * slot + 1)
        else:
            block, offs_m, m2, delta = _dkdv_rows(LSE, DELTA, stride_lz, stride_lh, stride_lm, off_z, off_h_kv, H_KV,
                                                  GROUP, lo, row_blocks, t, Lq, BLOCK_M, cols)
        mbarrier.wait(q_ready.index(slot), (t // STAGES) & 1)
        dk, dv, dsT = _dkdv_tile(k, v, q_smem.index(slot), do_smem.index(slot), dk, dv, zero_st, m2, delta, qk_scale,
                                 offs_kn, offs_m, block, full_lo, causal_shift, BLOCK_M, HEAD_DIM, IS_CAUSAL, op_layout,
                                 False, True, STATS_SMEM)
        ds_smem.store(dsT)
        fence_async_shared()
        _cta_barrier()  # (every warp's rows of dS^T in before any warp group's dQ product reads them)
        if DQ_T:
            dq = warpgroup_mma(k.permute((1, 0)), ds_smem, zero_dq, use_acc=False, is_async=True)
        else:
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k, zero_dq, use_acc=False, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(dsT, op_layout), q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM]), dk,
                           is_async=True)
        dv, dq = _own_mma_wait(1, (dv, dq))
        mbarrier.wait(dq_empty.index(buf), ((t // 2) & 1) ^ 1)  # (its add of two tiles ago has read it)
        staged = dq_smem.index(buf).reshape([BLOCK_M, HEAD_DIM])
        if DQ_T:
            staged.store(gl.permute(dq, (1, 0)))
        else:
            staged.store(dq)
        fence_async_shared()
        dk = _own_mma_wait(0, (dk, ))
        # (every warp group's products of this tile done and its dQ staged: dS^T, the slot and the buffer free)
        _cta_barrier()
        mbarrier.arrive(dq_ready.index(buf), count=1)
        mbarrier.arrive(q_empty.index(slot), count=1)
    _store_dk_dv(dk, dv, scale, dk_desc, dv_desc, k_smem, v_smem, off_z, off_h_kv, key_start, BLOCK_N, HEAD_DIM)


@gluon.jit
def _gluon_bwd_ws(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, DELTA,
    stride_lz, stride_lh, stride_lm,
    scale, H_KV, GROUP, Lq, Lk, causal_shift,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, DQ_T: gl.constexpr, num_warps: gl.constexpr, STATS_SMEM: gl.constexpr = False,
):
    """``_gluon_bwd_fused`` (DQ_TMA, DQ_FIRST) with FlashAttention-3's warp roles: the ``num_warps``
    consumer warps (``_ws_consumer``) only wait, multiply and compute p and dS; a loader warp
    (``_ws_loader``) keeps the Q/dO ring of STAGES slots full; a dQ warp (``_ws_dq_writer``) adds each
    staged dQ tile into the float32 sum by the bulk reduce-add (triton >= 3.9). K and V are loaded before
    the roles split. Not bitwise reproducible (dQ's additions)."""
    dtype: gl.constexpr = q_desc.dtype
    start_n = gl.program_id(0)
    off_hz = gl.program_id(1)
    off_z = off_hz // H_KV
    off_h_kv = off_hz % H_KV
    key_start = start_n * BLOCK_N
    ds_shared: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, BLOCK_M * 2), element_bitwidth=16,
                                                   rank=2)
    k_smem, v_smem, q_smem, do_smem, kv_bars, q_ready, lo, full_lo, row_blocks, n_tiles = _key_block_start(
        q_desc, k_desc, v_desc, do_desc, off_z, off_h_kv, key_start, GROUP, Lq, causal_shift, BLOCK_M, BLOCK_N,
        HEAD_DIM, STAGES, IS_CAUSAL, False)
    kv_bar = kv_bars.index(0)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_shared)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, HEAD_DIM], dq_desc.layout)
    stats_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_empty = _barriers(STAGES, 1)
    dq_ready = _barriers(2, 1)
    dq_empty = _barriers(2, 1)
    fence_async_shared()
    gl.warp_specialize([
        (_ws_consumer, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, stats_smem, kv_bar, q_ready, q_empty,
                        dq_ready, dq_empty, dk_desc, dv_desc, LSE, DELTA, stride_lz, stride_lh, stride_lm, scale, H_KV,
                        GROUP, Lq, causal_shift, off_z, off_h_kv, key_start, lo, full_lo, row_blocks, n_tiles, BLOCK_M,
                        BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL, DQ_T, num_warps, STATS_SMEM)),
        (_ws_loader, (q_desc, do_desc, q_smem, do_smem, q_ready, q_empty, off_z, off_h_kv, GROUP, lo, row_blocks,
                      n_tiles, LSE, DELTA, stride_lz, stride_lh, stride_lm, H_KV, Lq, stats_smem, BLOCK_M, STAGES,
                      STATS_SMEM)),
        (_ws_dq_writer, (dq_desc, dq_smem, dq_ready, dq_empty, off_z, off_h_kv, GROUP, lo, row_blocks, n_tiles,
                         BLOCK_M)),
    ], [1, 1], [WORKER_REGS, WORKER_REGS])
    _invalidate(kv_bars, 1)
    _invalidate(q_ready, STAGES)
    _invalidate(q_empty, STAGES)
    _invalidate(dq_ready, 2)
    _invalidate(dq_empty, 2)


def tiles(head_dim: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int, bool]]:
    """((BLOCK_M, BLOCK_N, STAGES, num_warps) of the dQ pass, (BLOCK_M, BLOCK_N, STAGES, num_warps,
    OVERLAP) of the dK/dV pass): the tl backward's shapes (128 rows x 64 keys for dQ, 128 keys x 64 rows
    for dK/dV, two warp groups), three stages where a tile's products overlap the next tile's (a
    slot is refilled a tile later); the dK/dV overlap off at D 128, where it spills at row tiles of 64.
    Measured on the H200 (``tools/probe.py gluon_bwd``): at D 128 no overlap beats the spilling one and
    the one at row tiles of 32 (four stages), which also loses at D 64."""
    if head_dim == 64:
        return (128, 64, 3, 8), (64, 128, 3, 8, True)
    return (128, 64, 3, 8), (64, 128, 2, 8, False)


def serves(q, k, v, out, grad_out, dq, dk, dv) -> bool:
    """Whether this backward takes these tensors: an sm_90 GPU, float16/bfloat16, D = Dv in HEAD_DIMS,
    every tensor TMA-ready (``gluon_attention._tma_ready``) and the gradients of their inputs' dtype.
    The caller checks the rest (no mask, dropout, soft-capping, ALiBi, window: causal or not)."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)
            and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in HEAD_DIMS
            and k.shape[-1] == v.shape[-1] == q.shape[-1]
            and all(t.dtype == q.dtype and _tma_ready(t) for t in (q, k, v, out, grad_out, dq, dk, dv)))


def backward(q, k, v, out, grad_out, lse, scale: float, causal_shift: int | None, grad_lse=None,
             dq=None, dk=None, dv=None, delta=None, dkdv: tuple | None = None):
    """dq, dk, dv of attention(q, k, v) (q (B, H, Lq, D), k/v (B, H_kv, Lk, D); out and lse its forward's,
    lse (B, H, Lq) float32) given grad_out (and grad_lse, the gradient of the log-sum-exp, or None).
    ``causal_shift``: None (no mask) or s, row i seeing keys j <= i + s. Buffers given are written (dq
    (B, H, Lq, D), dk/dv (B, H_kv, Lk, D), delta (B·H, Lq) float32 scratch); the rest are allocated.
    ``dkdv``: the dK/dV pass's (BLOCK_M, BLOCK_N, STAGES, num_warps, OVERLAP) instead of ``tiles``' (a
    probe's comparison, a test's)."""
    B, H, Lq, D = q.shape
    H_kv, Lk = k.shape[1], k.shape[2]
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    delta = torch.empty(B * H, Lq, dtype=torch.float32, device=q.device) if delta is None else delta
    (bm1, bn1, stages1, warps1), default_dkdv = tiles(D)
    bm2, bn2, stages2, warps2, overlap2 = dkdv or default_dkdv
    is_causal, shift = causal_shift is not None, 0 if causal_shift is None else causal_shift
    dlse = grad_lse if grad_lse is not None else lse  # never read without WITH_DLSE
    _gluon_bwd_dq[(triton.cdiv(Lq, bm1), B * H)](
        _descriptor(q, bm1), _descriptor(k, bn1), _descriptor(v, bn1), _descriptor(grad_out, bm1),
        _descriptor(dq, bm1), out, lse, dlse, delta,
        out.stride(0), out.stride(1), out.stride(2), *lse.stride(), *dlse.stride(),
        scale, H, H // H_kv, Lq, Lk, shift,
        BLOCK_M=bm1, BLOCK_N=bn1, HEAD_DIM=D, STAGES=stages1, IS_CAUSAL=is_causal,
        WITH_DLSE=grad_lse is not None, num_warps=warps1, **COMPILE_OPTIONS)
    _gluon_bwd_dkdv[(triton.cdiv(Lk, bn2), B * H_kv)](
        _descriptor(q, bm2), _descriptor(k, bn2), _descriptor(v, bn2), _descriptor(grad_out, bm2),
        _descriptor(dk, bn2), _descriptor(dv, bn2), lse, delta, *lse.stride(),
        scale, H_kv, H // H_kv, Lq, Lk, shift,
        BLOCK_M=bm2, BLOCK_N=bn2, HEAD_DIM=D, STAGES=stages2, IS_CAUSAL=is_causal, OVERLAP=overlap2,
        num_warps=warps2, **COMPILE_OPTIONS)
    return dq, dk, dv


def fused_tile(head_dim: int) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, STAGES, num_warps, DQ_T) of the one-pass backward: the dK/dV pass's at D 64; at
    D 128 row tiles of 32 and dQ^T's product, which spill least (benchmarks/NOTES.md; a first choice, to
    be measured)."""
    return (64, 128, 2, 8, False) if head_dim == 64 else (32, 128, 3, 8, True)


def ws_tile(head_dim: int) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, STAGES, num_warps, DQ_T) of the warp-specialised one pass, the fastest over the lengths
    timed (benchmarks/NOTES.md): ``fused_tile``'s at D 64; at D 128 FlashAttention-3's 64 rows by 128 keys with
    dQ^T's product, which its consumers' 240 registers hold (the plain one pass spills there)."""
    return fused_tile(head_dim) if head_dim == 64 else (64, 128, 2, 8, True)


apply_interpreter_fixes()  # (the launches before and after the one pass are tl kernels, which it runs)
_prologue_launcher = CachedLauncher(_one_pass_prologue)
_epilogue_launcher = CachedLauncher(_one_pass_epilogue)
_SUM_ROWS = 64  # (BLOCK_M of the launches before and after the one pass: reads and writes only)


def one_pass_sums(out, grad_out, grad_lse=None, delta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta, dq_sum) that the one pass starts from, in one launch: delta = rowsum(grad_out * out) -
    grad_lse, float32 (B·H, Lq) (into ``delta``, contiguous, (B·H, Lq) or (B, H, Lq), where given); dq_sum
    float32 zeros (B, H, Lq, D), contiguous. ``out``, ``grad_out``: (B, H, Lq, D), any strides; ``grad_lse``:
    (B, H, Lq) float32 or None."""
    B, H, Lq, D = out.shape
    if delta is None:
        delta = torch.empty(B * H, Lq, dtype=torch.float32, device=out.device)
    dq_sum = torch.empty(B, H, Lq, D, dtype=torch.float32, device=out.device)
    grid, args, meta = _prologue_args(out, grad_out, grad_lse, delta, dq_sum)
    _prologue_launcher(grid, *args, num_warps=4, num_stages=1, **meta)
    return delta, dq_sum


def _prologue_args(out, grad_out, grad_lse, delta, dq_sum) -> tuple[tuple, tuple, dict]:
    """(grid, runtime arguments, constexprs) of ``one_pass_sums``' launch (``_one_pass_prologue``)."""
    B, H, Lq, D = out.shape
    dlse = grad_lse if grad_lse is not None else delta  # (never read without WITH_DLSE)
    m_blocks = triton.cdiv(Lq, _SUM_ROWS)
    args = (out, grad_out, dlse, delta, dq_sum, *out.stride(), *grad_out.stride(),
            *(grad_lse.stride() if grad_lse is not None else (0, 0, 0)), H, Lq, m_blocks)
    meta = dict(HEAD_DIM=D, BLOCK_M=_SUM_ROWS, BLOCK_D=triton.next_power_of_2(D), WITH_DLSE=grad_lse is not None)
    return (m_blocks * B * H, ), args, meta


def one_pass_dq(dq_sum, scale: float, dtype: torch.dtype, dq=None) -> torch.Tensor:
    """dQ from the one pass's float32 sum (B, H, Lq, D), contiguous: ``dq_sum * scale`` rounded once to
    ``dtype``, in one launch, into ``dq`` (contiguous, that shape and dtype) or a new contiguous tensor."""
    B, H, Lq, D = dq_sum.shape
    if dq is None:
        dq = torch.empty(B, H, Lq, D, dtype=dtype, device=dq_sum.device)
    elif dq.shape != dq_sum.shape or dq.dtype != dtype or not dq.is_contiguous():
        raise ValueError(f"dq must be a contiguous {tuple(dq_sum.shape)} {dtype} tensor, got {tuple(dq.shape)} "
                         f"{dq.dtype} with strides {dq.stride()}")
    grid, args, meta = _epilogue_args(dq_sum, dq, scale)
    _epilogue_launcher(grid, *args, num_warps=4, num_stages=1, **meta)
    return dq


def _epilogue_args(dq_sum, dq, scale: float) -> tuple[tuple, tuple, dict]:
    """(grid, runtime arguments, constexprs) of ``one_pass_dq``'s launch (``_one_pass_epilogue``)."""
    B, H, Lq, D = dq_sum.shape
    m_blocks = triton.cdiv(Lq, _SUM_ROWS)
    meta = dict(HEAD_DIM=D, BLOCK_M=_SUM_ROWS, BLOCK_D=triton.next_power_of_2(D))
    return (m_blocks * B * H, ), (dq_sum, dq, scale, Lq, m_blocks), meta


def bulk_reduce_add() -> bool:
    """Whether the installed Triton's Gluon has the copy engine's bulk reduce-add (``hopper.tma.async_atomic_add``,
    triton 3.9; not in 3.6), which ``backward_fused(dq_tma=True)`` adds dQ by."""
    return _bulk_reduce_add is not None


def backward_fused(q, k, v, out, grad_out, lse, scale: float, causal_shift: int | None, grad_lse=None,
                   dk=None, dv=None, dq_tma: bool = False, dq_first: bool = False, tile: tuple | None = None,
                   specialized: bool = False, dq=None, stats_smem: bool = False, delta=None):
    """``backward``'s gradients in one pass (``_gluon_bwd_fused``): delta and dQ's zeroed float32 sum first
    (``one_pass_sums``, one launch), dQ summed by atomics (``dq_tma``: by the copy engine's bulk reduce-add, where
    ``bulk_reduce_add()``), then scaled and rounded (``one_pass_dq``, one launch); ``dq`` (contiguous), ``dk``,
    ``dv``: buffers to write, else allocated. ``dq_first``: dK's product issued after dQ's (the kernel's
    DQ_FIRST); ``tile``: (BLOCK_M, BLOCK_N, STAGES, num_warps, DQ_T) instead of ``fused_tile``'s (``ws_tile``'s
    where ``specialized``; a probe's comparison, a test's);
    ``specialized``: FlashAttention-3's warp roles, a loader warp and a dQ warp beside the consumers (``_gluon_bwd_ws``:
    dQ by the bulk reduce-add, dK after dQ; what ``backward_plan`` runs); ``stats_smem`` (with ``specialized``): each
    row tile's m2 and delta read from shared memory where used (its STATS_SMEM; what ``backward_plan`` runs),
    else held in registers through the tile; ``delta``: its float32 scratch (``one_pass_sums``'), else allocated.
    Not bitwise reproducible (dQ's additions)."""
    if (dq_tma or specialized) and not bulk_reduce_add():
        raise ValueError(f"dq_tma=True and specialized=True need Gluon's hopper.tma.async_atomic_add (triton 3.9 or "
                         f"later); this is triton {triton.__version__}")
    B, H, Lq, D = q.shape
    H_kv, Lk = k.shape[1], k.shape[2]
    delta, dq_sum = one_pass_sums(out, grad_out, grad_lse, delta)
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if specialized:
        grid, args, meta = _ws_launch(q, k, v, grad_out, dk, dv, dq_sum, lse, delta, scale, causal_shift, tile,
                                      stats_smem)
        _gluon_bwd_ws[grid](*args, **meta)
        return one_pass_dq(dq_sum, scale, q.dtype, dq), dk, dv
    bm, bn, stages, warps, dq_t = tile or fused_tile(D)
    q_desc = _descriptor(q, bm)
    _gluon_bwd_fused[(triton.cdiv(Lk, bn), B * H_kv)](
        q_desc, _descriptor(k, bn), _descriptor(v, bn), _descriptor(grad_out, bm),
        _descriptor(dk, bn), _descriptor(dv, bn), dq_sum, _descriptor(dq_sum, bm) if dq_tma else q_desc, lse, delta,
        *dq_sum.stride()[:3], *lse.stride(), scale, H_kv, H // H_kv, Lq, Lk,
        0 if causal_shift is None else causal_shift,
        BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D, STAGES=stages, IS_CAUSAL=causal_shift is not None, DQ_T=dq_t,
        DQ_TMA=dq_tma, DQ_FIRST=dq_first, num_warps=warps, **COMPILE_OPTIONS)
    return one_pass_dq(dq_sum, scale, q.dtype, dq), dk, dv


def _ws_launch(q, k, v, grad_out, dk, dv, dq_sum, lse, delta, scale: float, causal_shift: int | None,
               tile: tuple | None, stats_smem: bool) -> tuple[tuple, tuple, dict]:
    """(grid, runtime arguments, constexprs and options) of ``backward_fused``'s warp-specialised launch
    (``_gluon_bwd_ws``): the seven TMA descriptors (q, k, v, grad_out, dk, dv, dQ's sum) first, then the
    log-sum-exp and delta; ``tile`` (BLOCK_M, BLOCK_N, STAGES, num_warps, DQ_T) or ``ws_tile``'s."""
    B, H, Lq, D = q.shape
    H_kv, Lk = k.shape[1], k.shape[2]
    bm, bn, stages, warps, dq_t = tile or ws_tile(D)
    args = (_descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(grad_out, bm),
            _descriptor(dk, bn), _descriptor(dv, bn), _descriptor(dq_sum, bm), lse, delta, *lse.stride(), scale,
            H_kv, H // H_kv, Lq, Lk, 0 if causal_shift is None else causal_shift)
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D, STAGES=stages, IS_CAUSAL=causal_shift is not None, DQ_T=dq_t,
                STATS_SMEM=stats_smem, num_warps=warps, **COMPILE_OPTIONS)
    return (triton.cdiv(Lk, bn), B * H_kv), args, meta


# The warp-specialised one pass, each row tile's stats read from shared memory, runs the Triton backend's backward
# (impl_triton.attention.backward) for the head dims and lengths where it timed faster than the tl backward
# (benchmarks/NOTES.md): D 64 and 128 from 1024 rows and keys; shorter lengths are untimed. A layout's first two
# calls plan (three launches, seven descriptors, Triton's JIT dispatch of the Gluon kernel), later ones run its
# bound launches (BoundOnePass); a call smaller than the Gluon forward's guard (gluon_attention.large_enough)
# keeps the tl backward. ATTENTION_GLUON=1 takes it for every backward it serves, 0 for none.
ONE_PASS_HEAD_DIMS = (64, 128)
ONE_PASS_MIN_LENGTH = 1024


@functools.cache
def builds_one_pass() -> bool:
    """Whether the ptxas Triton builds sm_90 with is CUDA 13's or later, as triton 3.9 ships it: CUDA 12.9's
    crashed (SIGSEGV) building the warp-specialised one pass for causal grouped heads, which a Triton pointed
    at an older toolkit (TRITON_PTXAS_BLACKWELL_PATH) would do."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return int(get_ptxas(90).version.split(".")[0]) >= 13
    except (AttributeError, TypeError, ValueError, RuntimeError):  # (no ptxas found, or one that says no version)
        return False


def one_pass(plan) -> bool:
    """Whether the warp-specialised one pass (``backward_plan``) runs a ``common.plan.BackwardPlan``: no
    deterministic backward asked (its dQ sums land in any order), ``ATTENTION_GLUON`` not 0, Gluon's bulk
    reduce-add in the installed Triton and a ptxas that builds it (``builds_one_pass``), D in
    ONE_PASS_HEAD_DIMS, Lq, Lk >= ONE_PASS_MIN_LENGTH and the forward's FLOPs at least ``large_enough``'s (unless
    ``ATTENTION_GLUON=1``), and a plan it serves (``serves_plan``)."""
    switch = gluon_switch()
    if plan.deterministic or switch == "0" or not bulk_reduce_add():
        return False
    q = plan.query
    if switch != "1" and (q.shape[-1] not in ONE_PASS_HEAD_DIMS
                          or min(q.shape[2], plan.key.shape[2]) < ONE_PASS_MIN_LENGTH
                          or not large_enough(*q.shape[:3], plan.key.shape[2], q.shape[3], plan.band is not None)):
        return False
    return serves_plan(plan) and builds_one_pass()  # (the version last: it runs ptxas once a process)


def serves_plan(plan) -> bool:
    """Whether the one pass computes a ``common.plan.BackwardPlan``'s gradients: no mask, dropout, soft-capping,
    ALiBi or packed sequences, a band with no left edge (causal, either alignment, or a right window alone),
    B·H_kv programs' rows within a grid axis (its second, CUDA's 65535), and tensors ``serves`` takes."""
    q = plan.query
    return (plan.attn_mask is None and not plan.dropout and plan.softcap == 0.0 and plan.alibi is None
            and plan.row_bands is None and (plan.band is None or plan.band[0] <= 1 - q.shape[2])
            and q.shape[0] * plan.key.shape[1] <= MAX_GRID_AXIS
            and serves(q, plan.key, plan.value, plan.out, plan.grad_out, plan.grad_query, plan.grad_key,
                       plan.grad_value)
            and plan.lse.stride(-1) == 1)


def backward_plan(plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``common.plan.BackwardPlan``'s gradients by the warp-specialised one pass (each row tile's m2 and delta
    read from shared memory, the faster of its two forms), into its buffers: ``(plan.grad_query, plan.grad_key,
    plan.grad_value)``; delta into ``plan.delta``."""
    causal_shift = None if plan.band is None else plan.band[1]
    return backward_fused(plan.query, plan.key, plan.value, plan.out, plan.grad_out, plan.lse, plan.scale,
                          causal_shift, grad_lse=plan.grad_lse, dq=plan.grad_query, dk=plan.grad_key,
                          dv=plan.grad_value, specialized=True, stats_smem=True, delta=plan.delta)


class BoundOnePass:
    """``backward_plan``'s three launches bound to a plan's layout (the Triton backend's ``bind_backward``; a
    later call of that layout passes its tensors in ``BackwardPlan.ROLES`` order, ``common.reuse.KeptBackward``).
    A call then allocates dQ's float32 sum and runs the launches before and after the one pass bound
    (``common.launch.BoundSlots``), and the one pass itself as ``gluon_attention.BoundGluon`` runs the Gluon
    forward: its seven descriptors rebased on the call's tensors and, once its compiled kernel is known,
    Triton's launcher called directly; no planning, no ``one_pass`` checks, no JIT dispatch. A call with a
    tensor the copy engine reads or writes off 16 bytes runs the tl backward's bound launches (``fallback``)."""

    SUM = len(BackwardPlan.ROLES)  # (dQ's sum: a call's tensors are the plan's roles, then it)
    # the roles of the one pass's descriptors, by position: q, k, v, grad_out, dk, dv, dQ's sum
    DESCRIPTOR_ROLES = (0, 1, 2, 4, 9, 10, SUM)
    TMA_ROLES = DESCRIPTOR_ROLES[:-1]  # (dQ's sum is the call's own allocation)

    def __init__(self, plan, fallback):
        q = plan.query
        causal_shift = None if plan.band is None else plan.band[1]
        dq_sum = torch.empty(*q.shape, dtype=torch.float32, device=q.device)  # (the layout's; not kept)
        grid, args, meta = _prologue_args(plan.out, plan.grad_out, plan.grad_lse, plan.delta, dq_sum)
        dlse = 6 if plan.grad_lse is not None else 7
        self.prologue = BoundSlots(_prologue_launcher, _prologue_launcher.positional(args, meta),
                                   ((0, 3), (1, 4), (2, dlse), (3, 7), (4, self.SUM)), grid, 4, 1)
        grid, args, meta = _epilogue_args(dq_sum, plan.grad_query, plan.scale)
        self.epilogue = BoundSlots(_epilogue_launcher, _epilogue_launcher.positional(args, meta),
                                   ((0, self.SUM), (1, 8)), grid, 4, 1)
        grid, args, self.meta = _ws_launch(q, plan.key, plan.value, plan.grad_out, plan.grad_key, plan.grad_value,
                                           dq_sum, plan.lse, plan.delta, plan.scale, causal_shift, None, True)
        self.grid = (*grid, 1)
        self.sum_shape = tuple(q.shape)
        self.templates = args[:7]  # (rebased on each call's tensors; the plan's are not kept)
        for template in self.templates:
            template.base = None
        self.args = [None] * 9 + list(args[9:])  # (the descriptors, the log-sum-exp and delta: each call's)
        self.constexprs = _runner_constexprs(_gluon_bwd_ws, self.meta, len(args))
        self.fallback = fallback
        self.kernels: dict = {}  # the compiled one pass per alignment of the call's log-sum-exp and delta

    def __call__(self, tensors) -> None:
        pointers = [tensors[role].data_ptr() for role in self.TMA_ROLES]
        if any(pointer & 15 for pointer in pointers):
            self.fallback(tensors)
            return
        q = tensors[0]
        tensors = (*tensors, torch.empty(self.sum_shape, dtype=torch.float32, device=q.device))
        self.prologue(tensors)
        args = self.args.copy()
        args[:7] = [_rebased(t, tensors[role]) for t, role in zip(self.templates, self.DESCRIPTOR_ROLES)]
        lse, delta = tensors[5], tensors[7]
        launch_kept(self.kernels, alignment([lse.data_ptr(), delta.data_ptr()]), _gluon_bwd_ws, self.grid, self.meta,
                    self.constexprs, args, ((7, lse), (8, delta)))
        self.epilogue(tensors)
