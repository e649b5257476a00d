"""Attention over a paged KV cache, and appending to it, as hand-written Triton kernels.

``_paged_fwd``: the forward of ``impl_triton.kernels`` over keys and values gathered
page by page through a block table (one sequence per batch entry, its length read on the
device), with split keys merged as there, and its windows (a band around each row's
position: key blocks outside it never visited), soft-capping, sinks, ALiBi and log-sum-exp.
``_append_kv``: new tokens' keys and values into their slots. ``_rotary``: the rotary
embedding of new queries and keys at their positions (FlashAttention's kvcache call).
"""

from __future__ import annotations

import triton
import triton.language as tl

from common.jit_helpers import (
    TANH_APPROX,
    WIDEN_F16_ROWS,
    _alibi_bias,
    _cap_factors,
    _in_band,
    _keep_widened,
    _key_stages,
    _narrow_query,
    _tanh,
    _to_e4m3,
    _widen,
)
from impl_triton.kernels import LN2, LOG2E, _last_split_merges, _load_tile

# -- a paged KV cache ----------------------------------------------------------------------

@triton.jit(do_not_specialize=["kernel_merge"])
def _paged_fwd(
    Q, K_CACHE, V_CACHE, TABLE, SEQLENS, LEFTPAD, QLENS, SINK, SLOPES, K_DESCALE, V_DESCALE, O, LSE, OUT, LSE_OUT,
    COUNTS,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tz, stride_tb,
    stride_sz, stride_sh, stride_sm,
    stride_az, stride_ah, stride_am,
    stride_kdz, stride_kdh, stride_vdz, stride_vdh,
    stride_oz, stride_oh, stride_om, stride_os, stride_od,
    H, GROUP, Lq, LQ_SEQ, NUM_PAGES, MAX_PAGES, scale, M_BLOCKS, NUM_SPLITS, BLOCKS_PER_SPLIT, band_lo, band_hi,
    softcap, kernel_merge,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, VALUE_COLUMNS: tl.constexpr,
    PAGE_RUN: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BANDED: tl.constexpr,
    WITH_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr, MERGE_LSE: tl.constexpr, ALIBI: tl.constexpr,
    LEFTPADDED: tl.constexpr, QUERY_LENGTHS: tl.constexpr, DESCALE: tl.constexpr, WIDEN: tl.constexpr,
    WIDE_PAGES: tl.constexpr, PAGE_BLOCKS: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head) against the keys of one
    split of that sequence (BLOCKS_PER_SPLIT steps), BLOCK_N keys per step, gathered key
    by key from their pages: any page size (PAGE), from one token (a table entry per key)
    to pages of many steps. VALUE_COLUMNS: the value pages are stored column-major (a page's
    keys contiguous for each head and column; stride_vs 1), read in vectors along the keys:
    PAGE_RUN = gcd(PAGE, BLOCK_N), aligned runs of that many keys of a step lie in one page.

    Page j of sequence z is block TABLE[z, j] of the caches (clamped into the cache:
    a bad entry reads a wrong page, never outside); the sequence has SEQLENS[z] keys
    (clamped to the table's MAX_PAGES * PAGE).
    Rows may be grouped-query heads packed into rows (GROUP = 1 then): row r is
    query row r % LQ_SEQ of its head, at position SEQLENS[z] - LQ_SEQ + r % LQ_SEQ
    (bottom-right). BANDED: the row at position p sees keys p + band_lo .. p + band_hi
    (causal, a window, or both: ``common.paged.paged_band``), and the program visits
    only the key blocks its rows' bands reach (``_key_stages`` on the rows' positions).
    SOFTCAP: scores become softcap * tanh(s / softcap) (as ``_attn_fwd``). SINKS: SINK
    (B, H, Lq; strides) holds each row's sink logit, which starts the online softmax of
    the split that starts at the first key (m_i = sink, l_i = 1): one split counts it.
    ALIBI: -slope * |position - key| added to the (capped) scores, each row's slope
    SLOPES[z, h, r] (its head's, as SINK's logits). LEFTPADDED: sequence z's keys start
    at LEFTPAD[z] (the blocks before it not visited; the rows' positions unchanged).
    QUERY_LENGTHS: sequence z has QLENS[z] queries, rows r % LQ_SEQ < QLENS[z], at positions
    SEQLENS[z] - QLENS[z] + r % LQ_SEQ; its other rows see no key (output 0).
    DESCALE: FP8 caches; K_DESCALE, V_DESCALE (B, H_kv; strides) hold each sequence and K/V
    head's descales (the scores' scale takes the key's, the output the value's), and WIDEN
    widens each FP8 tile for a float16 product (a bfloat16 query narrowed to float16: as _attn_fwd).
    WITH_LSE: the log-sum-exp (natural log) of each row into LSE, (B, H, Lq) or, SPLIT,
    the partials' (B, H, Lq, NUM_SPLITS), contiguous. SPLIT: O and LSE are the float32
    partials that the last program of each row block merges into OUT and, MERGE_LSE,
    LSE_OUT (B, H, Lq) (as in _attn_fwd). WIDE_PAGES: a cache's storage holds 2^31 elements or
    more, so a key's offset within it (page, slot) is taken in 64 bits; in 32 otherwise.
    PAGE_BLOCKS: column-major value pages whose (Dv, PAGE) block for a head is one run of memory
    (stride_vd == PAGE), PAGE a power of two below BLOCK_N: a step's values are read as its
    BLOCK_N / PAGE pages' runs, each warp along one run, then permuted into the (BLOCK_N, Dv) tile
    (a (BLOCK_N, Dv) load puts a warp across 8 pages' columns, PAGE keys each).
    """
    start_m = tl.program_id(0) % M_BLOCKS
    off_hz = tl.program_id(0) // M_BLOCKS
    split = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_h_kv = off_h // GROUP

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Lq
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V

    q = tl.load(Q + off_z * stride_qz + off_h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    Lk = tl.minimum(tl.load(SEQLENS + off_z), MAX_PAGES * PAGE)  # a bad length reads no entry past the table
    row_ok = m_ok
    new_tokens = LQ_SEQ
    if QUERY_LENGTHS:  # (rows past a sequence's queries are padding)
        new_tokens = tl.load(QLENS + off_z)
        row_ok = offs_m % LQ_SEQ < new_tokens
    last_key = Lk - new_tokens + offs_m % LQ_SEQ  # the key at each row's position
    score_scale = scale
    out_scale = 1.0
    if DESCALE:  # real values are the stored ones times their descales (one of each, loaded once)
        score_scale = scale * tl.load(K_DESCALE + off_z * stride_kdz + off_h_kv * stride_kdh)
        out_scale = tl.load(V_DESCALE + off_z * stride_vdz + off_h_kv * stride_vdh)
        q, score_scale = _narrow_query(q, score_scale, WIDEN)  # (a bfloat16 query on float16-widened keys)
    qk_scale = score_scale * LOG2E
    cap_in, cap_out = _cap_factors(score_scale, softcap, SOFTCAP)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo = split * BLOCKS_PER_SPLIT
    alibi = 0.0
    if ALIBI:  # each row's slope (its head's: packed rows are several heads'), in base-2 units
        alibi = tl.load(SLOPES + off_z * stride_az + off_h * stride_ah + offs_m.to(tl.int64) * stride_am, mask=m_ok,
                        other=0.0)[:, None] * LOG2E
    if SINKS:  # a logit with no value: it starts the online softmax, once per row (the first split's)
        sink = tl.load(SINK + off_z * stride_sz + off_h * stride_sh + offs_m.to(tl.int64) * stride_sm, mask=m_ok,
                       other=0.0)
        m_i = tl.where(lo == 0, sink * LOG2E, m_i)
        l_i = tl.where(lo == 0, 1.0, l_i)
    # the split's key blocks that its rows' bands reach (one masked loop: every step may
    # hold keys past the length, or outside a band)
    first, _, _, end = _key_stages(last_key, lo, lo + BLOCKS_PER_SPLIT, Lk, band_lo, band_hi, BLOCK_N, BANDED)
    key_start = 0
    if LEFTPADDED:  # (a start past the length: no key)
        key_start = tl.load(LEFTPAD + off_z)
        first = tl.maximum(first, tl.minimum(key_start, Lk) // BLOCK_N)
        end = tl.maximum(end, first)
    if QUERY_LENGTHS:  # a block of padding rows only reads no key (queries padded to a CUDA graph's bound)
        end = tl.where(tl.max(row_ok.to(tl.int32), 0) > 0, end, first)
    table = TABLE + off_z * stride_tz
    k_base = K_CACHE + off_h_kv * stride_kh + offs_d[None, :] * stride_kd
    v_base = V_CACHE + off_h_kv * stride_vh + offs_dv[None, :] * stride_vd
    # Column-major value pages load unmasked (a key mask would split their vectors), so a step holding
    # keys past the length or before a left pad zeroes those values in registers. Only a first and a
    # last step can: they run apart (phases 0 and 2, a step at most each, not pipelined), and the main
    # loop's values (phase 1) go from the copy engine to the product untouched.
    mid_lo, mid_hi = first, end
    if VALUE_COLUMNS:
        if LEFTPADDED:
            mid_lo = tl.minimum(tl.maximum(first, tl.cdiv(key_start, BLOCK_N)), end)
        mid_hi = tl.minimum(tl.maximum(Lk // BLOCK_N, mid_lo), end)
    for phase in tl.static_range(3):
        if phase == 1 or (VALUE_COLUMNS and (phase == 2 or LEFTPADDED)):
            step_lo = first if phase == 0 else (mid_lo if phase == 1 else mid_hi)
            step_hi = mid_lo if phase == 0 else (mid_hi if phase == 1 else end)
            for j in tl.range(step_lo, step_hi, num_stages=None if phase == 1 else 1):
                offs_kn = j * BLOCK_N + offs_n
                key_ok = (offs_kn < Lk) & (offs_kn >= key_start)
                # each key's page (PAGE neighbours share one table entry), clamped into the cache
                entry_ok = key_ok
                if VALUE_COLUMNS:  # (a mask constant over each page's keys: the hint below holds)
                    entry_ok = offs_kn < MAX_PAGES * PAGE
                page = tl.load(table + (offs_kn // PAGE) * stride_tb, mask=entry_ok, other=0)
                page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1)
                if VALUE_COLUMNS:
                    # aligned runs of PAGE_RUN keys share an entry: each column of a value page loads in vectors
                    page = tl.max_constancy(page, PAGE_RUN)
                slot = offs_kn % PAGE
                if WIDE_PAGES:  # (a cache of 2^31 elements or more; 32-bit offsets take fewer instructions)
                    page, slot = page.to(tl.int64), slot.to(tl.int64)
                k = tl.load(k_base + (page * stride_kb + slot * stride_ks)[:, None],
                            mask=key_ok[:, None] & d_ok[None, :], other=0.0)
                k = _widen(k, WIDEN)
                qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
                if SOFTCAP:  # softcap * tanh(s / softcap), in base 2
                    qk = _tanh(qk * cap_in, SOFTCAP == TANH_APPROX) * cap_out
                else:
                    qk = qk * qk_scale
                if ALIBI:  # (each row's position is its last key)
                    qk += _alibi_bias(last_key, offs_kn, alibi, 0)
                valid = key_ok[None, :]
                if BANDED:
                    valid = valid & _in_band(last_key, offs_kn, band_lo, band_hi)
                if QUERY_LENGTHS:
                    valid = valid & row_ok[:, None]
                qk = tl.where(valid, qk, float("-inf"))
                m_ij = tl.maximum(m_i, tl.max(qk, 1))
                m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # a row with no key yet: p = 0, not NaN
                p = tl.math.exp2(qk - m_sub[:, None])
                alpha = tl.math.exp2(m_i - m_sub)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
                v_ptrs = v_base + (page * stride_vb + slot * stride_vs)[:, None]
                if PAGE_BLOCKS:  # (the step's pages' table entries, clamped: every address lies in the caches)
                    PAGES_PER_STEP: tl.constexpr = BLOCK_N // PAGE
                    offs_p = j * PAGES_PER_STEP + tl.arange(0, PAGES_PER_STEP)
                    pages = tl.load(table + offs_p * stride_tb, mask=offs_p < MAX_PAGES, other=0)
                    pages = tl.minimum(tl.maximum(pages, 0), NUM_PAGES - 1)
                    if WIDE_PAGES:
                        pages = pages.to(tl.int64)
                    offs_run = tl.arange(0, BLOCK_DV * PAGE)  # (column d, slot s) at d * PAGE + s
                    runs = V_CACHE + off_h_kv * stride_vh + pages[:, None] * stride_vb + offs_run[None, :]
                    v = _load_tile(runs, offs_p, offs_run < HEAD_DIM_V * PAGE, False, BLOCK_DV != HEAD_DIM_V)
                    v = tl.reshape(tl.permute(tl.reshape(v, (PAGES_PER_STEP, BLOCK_DV, PAGE)), (0, 2, 1)),
                                   (BLOCK_N, BLOCK_DV))
                    v = _widen(v, WIDEN)
                    if phase != 1:  # (a key past the length or before a left pad may hold anything, NaN too)
                        v = tl.where(key_ok[:, None], v, 0.0)
                elif VALUE_COLUMNS:  # (every address lies in the caches: pages clamped)
                    v = _widen(_load_tile(v_ptrs, key_ok, dv_ok, False, BLOCK_DV != HEAD_DIM_V), WIDEN)
                    if phase != 1:  # (a key past the length or before a left pad may hold anything, NaN too)
                        v = tl.where(key_ok[:, None], v, 0.0)
                else:
                    v = _widen(tl.load(v_ptrs, mask=key_ok[:, None] & dv_ok[None, :], other=0.0), WIDEN)
                    if WIDEN == WIDEN_F16_ROWS:  # (widened before the product's transpose)
                        v = _keep_widened(v, dv_ok)
                acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
                m_i = m_ij

    if WITH_LSE:  # -inf for a row with no key and no sink (m_i = -inf, l_i = 0)
        lse = (m_i + tl.math.log2(l_i)) * LN2
        tl.store(LSE + (off_hz.to(tl.int64) * Lq + offs_m) * NUM_SPLITS + split, lse, mask=m_ok)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # no key (an empty sequence, or a split past its end): 0
    o = acc / l_i[:, None]
    if DESCALE:
        o = o * out_scale
    o_ptrs = (O + off_z * stride_oz + off_h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_om + split * stride_os
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
    if SPLIT:
        if kernel_merge != 0:  # (otherwise _merge_kernel's launch merges them, as in _attn_fwd)
            _last_split_merges(COUNTS, O, LSE, OUT, LSE_OUT, off_hz.to(tl.int64) * Lq + offs_m, m_ok, NUM_SPLITS,
                               HEAD_DIM_V, BLOCK_M, BLOCK_DV, MERGE_LSE)


@triton.jit
def _append_kv(
    K_NEW, V_NEW, K_CACHE, V_CACHE, TABLE, SEQLENS, K_DESCALE, V_DESCALE,
    stride_nz, stride_nh, stride_nm, stride_nd,
    stride_wz, stride_wh, stride_wm, stride_wd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tz, stride_tb,
    stride_kdz, stride_kdh, stride_vdz, stride_vdh,
    H_KV, L_NEW, NUM_PAGES, MAX_PAGES,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, QUANTIZE: tl.constexpr,
):
    """One program: BLOCK_M new tokens of one (batch, K/V head), keys and values, into
    their slots: token i of sequence z goes to position SEQLENS[z] + i, that is slot
    (SEQLENS[z] + i) % PAGE of page TABLE[z, (SEQLENS[z] + i) // PAGE]. Tokens whose
    position falls past the table, or whose page entry is outside the cache, are not
    written. QUANTIZE: FP8 caches; each element is divided by its sequence and head's descale
    (K_DESCALE, V_DESCALE (B, H_kv; strides)) and rounded to e4m3 (``_to_e4m3``) as it is written."""
    off_zh = tl.program_id(0)
    off_z = (off_zh // H_KV).to(tl.int64)
    off_h = (off_zh % H_KV).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    pos = tl.load(SEQLENS + off_z) + offs_m
    slot_ok = (offs_m < L_NEW) & (pos >= 0) & (pos < MAX_PAGES * PAGE)
    page = tl.load(TABLE + off_z * stride_tz + (pos // PAGE) * stride_tb, mask=slot_ok, other=-1)
    slot_ok = slot_ok & (page >= 0) & (page < NUM_PAGES)
    page = page.to(tl.int64)
    slot = (pos % PAGE).to(tl.int64)
    rows_k = page * stride_kb + slot * stride_ks + off_h * stride_kh
    rows_v = page * stride_vb + slot * stride_vs + off_h * stride_vh
    k = tl.load(K_NEW + off_z * stride_nz + off_h * stride_nh + offs_m.to(tl.int64)[:, None] * stride_nm
                + offs_d[None, :] * stride_nd, mask=slot_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    if QUANTIZE:
        k = _to_e4m3(k, tl.load(K_DESCALE + off_z * stride_kdz + off_h * stride_kdh))
    tl.store(K_CACHE + rows_k[:, None] + offs_d[None, :] * stride_kd, k,
             mask=slot_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    v = tl.load(V_NEW + off_z * stride_wz + off_h * stride_wh + offs_m.to(tl.int64)[:, None] * stride_wm
                + offs_dv[None, :] * stride_wd, mask=slot_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])
    if QUANTIZE:
        v = _to_e4m3(v, tl.load(V_DESCALE + off_z * stride_vdz + off_h * stride_vdh))
    tl.store(V_CACHE + rows_v[:, None] + offs_dv[None, :] * stride_vd, v,
             mask=slot_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


@triton.jit
def _rotary(
    X1, X2, O1, O2, COS, SIN, STARTS,
    stride_xb, stride_xl, stride_xh, stride_xr,
    stride_yb, stride_yl, stride_yh, stride_yr,
    stride_ob, stride_ol, stride_oh, stride_or,
    stride_pb, stride_pl, stride_ph, stride_pr,
    stride_cs, stride_cr, stride_ss, stride_sr,
    H, L, HALF, ROWS,
    PER_ROW: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One program: BLOCK_L rows of one (batch, head) of the rotary embedding's pairs: x1
    (X1) and x2 (X2), (B, L, H, HALF) strided, become x1 cos - x2 sin (O1) and x1 sin + x2
    cos (O2) (O1, O2 strided as X1, X2 are: their own), the angles of position STARTS[b] +
    l (PER_ROW) or STARTS[b] (every row at one position) from rows of COS and SIN (ROWS,
    HALF); a position outside them is clamped into them. Computed in float32."""
    off_b = (tl.program_id(0) // H).to(tl.int64)
    off_h = (tl.program_id(0) % H).to(tl.int64)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    ok = (offs_l < L)[:, None] & (offs_r < HALF)[None, :]
    pos = tl.load(STARTS + off_b) + (offs_l if PER_ROW else offs_l * 0)
    pos = tl.minimum(tl.maximum(pos, 0), ROWS - 1).to(tl.int64)
    cos = tl.load(COS + pos[:, None] * stride_cs + offs_r[None, :] * stride_cr, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos[:, None] * stride_ss + offs_r[None, :] * stride_sr, mask=ok, other=0.0).to(tl.float32)
    rows = offs_l.to(tl.int64)[:, None]
    x1 = tl.load(X1 + off_b * stride_xb + off_h * stride_xh + rows * stride_xl + offs_r[None, :] * stride_xr, mask=ok,
                 other=0.0)
    x2 = tl.load(X2 + off_b * stride_yb + off_h * stride_yh + rows * stride_yl + offs_r[None, :] * stride_yr, mask=ok,
                 other=0.0)
    o1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
    o2 = x1.to(tl.float32) * sin + x2.to(tl.float32) * cos
    tl.store(O1 + off_b * stride_ob + off_h * stride_oh + rows * stride_ol + offs_r[None, :] * stride_or,
             o1.to(O1.dtype.element_ty), mask=ok)
    tl.store(O2 + off_b * stride_pb + off_h * stride_ph + rows * stride_pl + offs_r[None, :] * stride_pr,
             o2.to(O2.dtype.element_ty), mask=ok)
