"""Attention over a paged KV cache, appending to it and the rotary embedding of new tokens,
as NineToothed kernels: the arrangements, applications and premakes of ``_paged_fwd``,
``_append_kv`` and ``_rotary`` of ``impl_triton.paged_kernels``, in the vocabulary of
``impl_ninetoothed.kernels``.
"""

from __future__ import annotations

import functools

import ninetoothed.language as ntl
import triton
from ninetoothed import Tensor

from common.configs import padded_head_dim
from common.jit_helpers import (
    _alibi_bias,
    _cap_factors,
    _column_piece,
    _counted_join,
    _in_band,
    _joined_keys,
    _keep_widened,
    _key_stages,
    _narrow_query,
    _tanh,
    _to_e4m3,
    _widen,
)
from common.plan import LN2, LOG2E
from impl_ninetoothed.kernels import TANH_APPROX, WIDEN_F16_ROWS, _flags, _like, _rows_like
from impl_ninetoothed.tiles import _per_kv_head, _per_split, _row_slices, _rows

# -- a paged KV cache ----------------------------------------------------------------------

def _pages(cache, batch, heads, m_blocks, tile, block_d, num_splits=None, keys_last=False):
    """(num_pages, PAGE / tile, tile, H_kv, D) (a cache with each page's keys viewed as tiles of
    ``tile``, a constant) -> per program of (batch, heads, m_blocks[, S]), every page of the K/V
    head its query head reads, as a (num_pages, PAGE / tile) array of (tile, D) tiles: the program
    picks a page's tile by index (a gather: which page is data, read from the block table). The
    batch, the group's heads and the row blocks are broadcast (expand). ``keys_last``: the cache
    given as (num_pages, H_kv, D, PAGE / tile, tile) (value pages stored column-major, viewed with
    their contiguous keys last), in (D, tile) tiles. The tile's keys are a dimension of their own, of
    constant size, so a tile's loads check no key against the page's end (every tile is whole)."""
    if keys_last:
        group = heads // cache.shape[1]
        # (num_pages, H_kv, PAGE / tile) -> (H_kv, num_pages, PAGE / tile)
        arranged = cache.tile((1, 1, block_d, 1, tile)).squeeze((2, 4)).permute((1, 0, 2))
    else:
        group = heads // cache.shape[3]
        # (num_pages, PAGE / tile, H_kv) -> (H_kv, num_pages, PAGE / tile)
        arranged = cache.tile((1, 1, tile, 1, block_d)).squeeze((2, 4)).permute((2, 0, 1))
    arranged.dtype = arranged.dtype.squeeze((0, 1, 3))
    arranged = arranged.tile((1, -1, -1)).squeeze((1, 2))  # (H_kv,), each the head's array of tiles
    arranged.dtype = arranged.dtype.squeeze(0)
    arranged = arranged.unsqueeze(0).unsqueeze(2).unsqueeze(3)  # (1, H_kv, 1, 1)
    if num_splits is None:
        arranged = arranged.expand((batch, -1, group, m_blocks))
    else:
        arranged = arranged.unsqueeze(4).expand((batch, -1, group, m_blocks, num_splits))
    return arranged.flatten(1, 2)


def paged_arrangement(
    query, key_cache, value_cache, block_table, cache_seqlens, leftpad, query_lengths, scale, lq_seq, num_pages,
    band_lo, band_hi, softcap, sinks, slopes, k_descale, v_descale, output, lse, BANDED, WITH_LSE, DOT_PRECISION,
    SPLIT, TILES_PER_STEP, JOIN, JOIN_TILES, SOFTCAP, SINKS, ALIBI, LEFTPADDED, QUERY_LENGTHS, DESCALE, WIDEN,
    VALUE_COLUMNS, block_m, tile, block_d, block_dv, pages_per_split=None, value_columns=False,
):
    """One program per (batch, head, block of BLOCK_M query rows), and per split of the
    pages when ``pages_per_split`` is given: the block table's row for the batch entry
    (its split's part), (1,) tiles each; the sequence's length, first key and query count; all pages of the
    caches, given as (num_pages, PAGE / tile, tile, H_kv, D), in tiles of ``tile`` keys (a power of two from
    16 that divides the page size; ``value_columns``: the value cache given as (num_pages, H_kv, Dv,
    PAGE / tile, tile), its pages stored column-major, in (Dv, tile) tiles, see ``paged_application``);
    its rows' sink logits and ALiBi slopes ((B, H, Lq) views, as the log-sum-exp); its K/V head's
    descales ((B, H_kv) -> a (1,) tile each, as the dense forward's ``_per_kv_head``)."""
    query_arranged = _rows(query, block_m, block_d)
    batch, heads, m_blocks = query_arranged.shape
    split = pages_per_split is not None
    num_splits = output.shape[3] if split else None
    # (B, max_pages) -> per program its (part of the) row of (1,) tiles
    table = block_table.tile((1, 1))
    table.dtype = table.dtype.squeeze(0)
    table = table.tile((1, pages_per_split if split else -1))
    table.dtype = table.dtype.squeeze(0)
    table = table.unsqueeze(1).unsqueeze(2).expand((-1, heads, m_blocks, -1))  # (B, H, M, S)
    seqlens = cache_seqlens.tile((1,)).unsqueeze(1).unsqueeze(2).expand((-1, heads, m_blocks))
    starts = leftpad.tile((1,)).unsqueeze(1).unsqueeze(2).expand((-1, heads, m_blocks))
    new_tokens = query_lengths.tile((1,)).unsqueeze(1).unsqueeze(2).expand((-1, heads, m_blocks))
    sinks_arranged = _row_slices(sinks, block_m)
    slopes_arranged = _row_slices(slopes, block_m)
    descales = [_per_kv_head(x, heads, m_blocks, num_splits) for x in (k_descale, v_descale)]
    if split:
        query_arranged = _per_split(query_arranged, num_splits)
        seqlens = _per_split(seqlens, num_splits)
        starts = _per_split(starts, num_splits)
        new_tokens = _per_split(new_tokens, num_splits)
        sinks_arranged = _per_split(sinks_arranged, num_splits)
        slopes_arranged = _per_split(slopes_arranged, num_splits)
        output_arranged = output.tile((1, 1, block_m, 1, block_dv)).squeeze(4)
        output_arranged.dtype = output_arranged.dtype.squeeze((0, 1, 3))
        lse_arranged = lse.tile((1, 1, block_m, 1))
        lse_arranged.dtype = lse_arranged.dtype.squeeze((0, 1, 3))
    else:
        table = table.squeeze(3)
        output_arranged = _rows(output, block_m, block_dv)
        lse_arranged = _row_slices(lse, block_m)
    return (
        query_arranged, _pages(key_cache, batch, heads, m_blocks, tile, block_d, num_splits),
        _pages(value_cache, batch, heads, m_blocks, tile, block_dv, num_splits, keys_last=value_columns), table,
        seqlens, starts, new_tokens,
        scale, lq_seq, num_pages, band_lo, band_hi, softcap, sinks_arranged, slopes_arranged, *descales,
        output_arranged, lse_arranged, BANDED, WITH_LSE, DOT_PRECISION, SPLIT, TILES_PER_STEP, JOIN, JOIN_TILES,
        SOFTCAP, SINKS, ALIBI, LEFTPADDED, QUERY_LENGTHS, DESCALE, WIDEN, VALUE_COLUMNS,
    )


def paged_application(
    query, key_cache, value_cache, block_table, cache_seqlens, leftpad, query_lengths, scale, lq_seq, num_pages,
    band_lo, band_hi, softcap, sinks, slopes, k_descale, v_descale, output, lse, BANDED, WITH_LSE, DOT_PRECISION,
    SPLIT, TILES_PER_STEP, JOIN, JOIN_TILES, SOFTCAP, SINKS, ALIBI, LEFTPADDED, QUERY_LENGTHS, DESCALE, WIDEN,
    VALUE_COLUMNS,
):
    """BLOCK_M query rows against their sequence's pages (its split's), TILES_PER_STEP tiles
    an iteration, each its own products (a gather here reads one tile of one page, where ``_paged_fwd``
    of the Triton kernel gathers one BLOCK_N tile of keys from any pages), JOIN of them (1, 2, 4 or 8)
    one softmax update: their scores joined into one block, the probabilities split back into each
    tile's columns for its value product, or (JOIN_TILES) their key tiles joined into one block before one
    score product and their value tiles before one value product, rows interleaved for row-major value pages
    (``_joined_rows``; a product of 16 keys gives each of 4 warps the whole tile: joined, the warps split the
    keys); as
    ``_paged_fwd``: packed row r is query row r % lq_seq of its head, at position Lk - lq_seq + r % lq_seq
    (bottom-right); BANDED, it sees keys at position + band_lo .. position + band_hi, and the program walks
    only the tiles its rows' bands reach; SOFTCAP, SINKS, ALIBI, LEFTPADDED, QUERY_LENGTHS, DESCALE and WIDEN as
    there; a page entry outside the cache is clamped into it, a length past the table to the table.
    Tile t of the sequence is tile t % per_page of its page t // per_page. VALUE_COLUMNS: the value
    tiles come as (Dv, tile), their keys contiguous, and are transposed after the load: a (tile, Dv)
    tile of 16 keys runs 16 bytes along its contiguous keys, which the pipeliner loads synchronously,
    where a (Dv, tile) one goes by the copy engine (sm_90, triton 3.6 and 3.9)."""
    q = query
    offs_m = query.offsets(-2)
    TILE = key_cache.dtype.shape[0]
    per_page = key_cache.shape[1]  # tiles a page
    # the (1,) tile of this sequence's length; a bad one reads no entry past the table (as _paged_fwd)
    Lk = ntl.minimum(ntl.sum(cache_seqlens, 0), block_table.source.shape[-1] * per_page * TILE)
    rows_in_seq = offs_m % lq_seq
    new_tokens = lq_seq
    if QUERY_LENGTHS:  # (rows past a sequence's queries are padding)
        new_tokens = ntl.sum(query_lengths, 0)
    last_key = Lk - new_tokens + rows_in_seq  # the key at each row's position
    score_scale = scale
    out_scale = 1.0
    if DESCALE:  # real values are the stored ones times their descales ((1,) tiles, loaded once)
        score_scale = scale * ntl.sum(k_descale, 0)
        out_scale = ntl.sum(v_descale, 0)
        q, score_scale = _narrow_query(q, score_scale, WIDEN)  # (a bfloat16 query on float16-widened keys)
    qk_scale = score_scale * LOG2E
    cap_in, cap_out = _cap_factors(score_scale, softcap, SOFTCAP)
    acc = ntl.zeros(output.shape, dtype=ntl.float32)
    l_i = ntl.zeros((query.shape[0],), dtype=ntl.float32)
    m_i = ntl.full((query.shape[0],), float("-inf"), dtype=ntl.float32)
    lo = ntl.min(block_table[0].offsets(-1), 0) * per_page  # the split's first tile
    alibi = 0.0
    if ALIBI:  # each row's slope (its head's: packed rows are several heads'), in base-2 units
        alibi = ntl.expand_dims(slopes, 1) * LOG2E  # (NineToothed reads x[:, None] as a tile index)
    if SINKS:  # a logit with no value: it starts the online softmax, once per row (the first split's)
        m_i = ntl.where(lo == 0, sinks * LOG2E, m_i)
        l_i = ntl.where(lo == 0, 1.0, l_i)
    # the split's tiles that its rows' bands reach; keys from tile `end` on are another
    # split's or no row's (a step's tiles past it repeat its last, masked)
    first, _, _, end = _key_stages(last_key, lo, lo + block_table.shape[0] * per_page, Lk, band_lo, band_hi, TILE,
                                   BANDED)
    key_start = 0
    if LEFTPADDED:  # (a start past the length: no key)
        key_start = ntl.sum(leftpad, 0)
        first = ntl.maximum(first, ntl.minimum(key_start, Lk) // TILE)
        end = ntl.maximum(end, first)
    if QUERY_LENGTHS:  # a block of padding rows only reads no key (queries padded to a CUDA graph's bound)
        end = ntl.where(ntl.max((rows_in_seq < new_tokens).to(ntl.int32), 0) > 0, end, first)
    key_end = ntl.minimum(Lk, end * TILE)
    # A step's tiles load whole (a gather reads one tile of a page), so a step holding keys past the
    # length or before a left pad (or repeats of the last tile) zeroes those values. Only a first and
    # a last step can: they run apart (phases 0 and 2, a step at most each, not pipelined), and the
    # main loop's values (phase 1) go to the product untouched.
    mid_lo = first
    if LEFTPADDED:  # (the first step, where it starts before the pad)
        mid_lo = ntl.where(first * TILE < key_start, ntl.minimum(first + TILES_PER_STEP, end), first)
    mid_hi = mid_lo + ntl.maximum(key_end // TILE - mid_lo, 0) // TILES_PER_STEP * TILES_PER_STEP
    for phase in triton.language.static_range(3):
        if phase != 0 or LEFTPADDED:
            step_lo = first if phase == 0 else (mid_lo if phase == 1 else mid_hi)
            step_hi = mid_lo if phase == 0 else (mid_hi if phase == 1 else end)
            for j in triton.language.range(step_lo, step_hi, TILES_PER_STEP, num_stages=None if phase == 1 else 1):
                # TILES_PER_STEP tiles an iteration, unrolled: their table entries and tiles are
                # independent loads, in flight together (one page of 16 keys an iteration left
                # the loop bound by each load's latency)
                for u in triton.language.static_range(TILES_PER_STEP // JOIN):
                    j0 = j + u * JOIN
                    for g in triton.language.static_range(JOIN):
                        t = ntl.minimum(j0 + g, end - 1)  # past the last tile: a masked repeat of it
                        page = ntl.minimum(ntl.maximum(ntl.sum(block_table[(t - lo) // per_page], 0), 0), num_pages - 1)
                        k_t = _widen(key_cache[page, t % per_page], WIDEN)
                        # the JOIN tiles (JOIN_TILES: the key tiles, else their scores) joined in key order
                        if JOIN_TILES:
                            if g == 0:  # (stand-ins until the counter sets them)
                                k = k_t
                                k_2 = k_t
                                k_4 = k_t
                            k, k_2, k_4 = _counted_join(k, k_2, k_4, k_t, g, True, not VALUE_COLUMNS)
                        else:
                            qk_t = ntl.dot(q, ntl.trans(k_t), input_precision=DOT_PRECISION)
                            if g == 0:
                                qk = qk_t
                                qk_2 = qk_t
                                qk_4 = qk_t
                            qk, qk_2, qk_4 = _counted_join(qk, qk_2, qk_4, qk_t, g, False, False)
                    if JOIN_TILES:
                        qk = ntl.dot(q, ntl.trans(k), input_precision=DOT_PRECISION)
                    # (inline: arange needs the constant)
                    offs_kn = j0 * TILE + ntl.arange(0, JOIN * key_cache.dtype.shape[0])
                    if JOIN_TILES:  # (row-major value pages: the joined blocks' rows interleave their tiles' keys)
                        offs_kn = j0 * TILE + _joined_keys(ntl.arange(0, JOIN * key_cache.dtype.shape[0]), TILE, JOIN,
                                                           not VALUE_COLUMNS)
                    key_ok = (offs_kn < key_end) & (offs_kn >= key_start)
                    if SOFTCAP:  # softcap * tanh(s / softcap), in base 2
                        qk = _tanh(qk * cap_in, SOFTCAP == TANH_APPROX) * cap_out
                    else:
                        qk = qk * qk_scale
                    if ALIBI:  # (each row's position is its last key)
                        qk = qk + _alibi_bias(last_key, offs_kn, alibi, 0)
                    valid = key_ok[None, :]
                    if BANDED:
                        valid = valid & _in_band(last_key, offs_kn, band_lo, band_hi)
                    if QUERY_LENGTHS:
                        valid = valid & (rows_in_seq < new_tokens)[:, None]
                    qk = ntl.where(valid, qk, float("-inf"))
                    m_ij = ntl.maximum(m_i, ntl.max(qk, 1))
                    m_sub = ntl.where(m_ij == float("-inf"), 0.0, m_ij)  # a row with no key yet: p = 0, not NaN
                    p = ntl.exp2(qk - m_sub[:, None])
                    alpha = ntl.exp2(m_i - m_sub)
                    l_i = l_i * alpha + ntl.sum(p, 1)
                    acc = acc * alpha[:, None]
                    # each tile's values times its columns of p (the tiles' table entries read again)
                    for g in triton.language.static_range(JOIN):
                        if JOIN > 1:  # (one tile: its entry as read above)
                            t = ntl.minimum(j0 + g, end - 1)
                            page = ntl.minimum(ntl.maximum(ntl.sum(block_table[(t - lo) // per_page], 0), 0),
                                               num_pages - 1)
                        v_t = value_cache[page, t % per_page]
                        if VALUE_COLUMNS:
                            v_t = ntl.trans(v_t)
                        v_t = _widen(v_t, WIDEN)
                        if JOIN_TILES:  # (joined as the key tiles; the value product after them)
                            if g == 0:
                                v = v_t
                                v_2 = v_t
                                v_4 = v_t
                            v, v_2, v_4 = _counted_join(v, v_2, v_4, v_t, g, True, not VALUE_COLUMNS)
                        else:
                            if WIDEN == WIDEN_F16_ROWS:  # (widened before the product's transpose)
                                cols = ntl.arange(0, value_cache.dtype.shape[1])  # (inline: arange needs the constant)
                                v_t = _keep_widened(v_t, cols < value_cache.source.shape[-1])
                            if phase != 1:  # (a slot past the length or before a left pad: any bits, NaN too)
                                offs_vn = (j0 + g) * TILE + ntl.arange(0, key_cache.dtype.shape[0])
                                value_ok = (offs_vn < key_end) & (offs_vn >= key_start)
                                v_t = ntl.where(value_ok[:, None], v_t, 0.0)
                            acc = ntl.dot(_column_piece(p, g, JOIN).to(v_t.dtype), v_t, acc,
                                          input_precision=DOT_PRECISION)
                    if JOIN_TILES:
                        if WIDEN == WIDEN_F16_ROWS:
                            cols = ntl.arange(0, value_cache.dtype.shape[1])  # (inline: arange needs the constant)
                            v = _keep_widened(v, cols < value_cache.source.shape[-1])
                        if phase != 1:  # (the step's slots past the length or before a left pad)
                            v = ntl.where(key_ok[:, None], v, 0.0)
                        acc = ntl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
                    m_i = m_ij

    if WITH_LSE:  # -inf for a row with no key and no sink (m_i = -inf, l_i = 0)
        lse = (m_i + ntl.log2(l_i)) * LN2  # noqa: F841 (a store)
    l_i = ntl.where(l_i == 0.0, 1.0, l_i)  # no key (an empty sequence, or a split past its end): 0
    o = acc / l_i[:, None]
    if DESCALE:
        o = o * out_scale
    output = o  # noqa: F841 (a store)


def append_arrangement(key, value, key_cache, value_cache, block_table, cache_seqlens, num_pages, k_descale,
                       v_descale, QUANTIZE, block_d, block_dv):
    """One program per (batch, K/V head, new token): its key and value rows, every slot of
    its head in the caches as a (num_pages, PAGE) array of (D,) tiles (the program stores
    into one by index: where a token goes is data), its sequence's block table row and
    length. (NineToothed indexes a tile array with scalars only, so a program cannot
    scatter a block of tokens to their different slots as the Triton kernel's does.)"""
    batch, heads, new_tokens = key.shape[0], key.shape[1], key.shape[2]

    def rows(x, block):
        arranged = x.tile((1, 1, 1, block)).squeeze(3)
        arranged.dtype = arranged.dtype.squeeze((0, 1, 2))
        return arranged

    def slots(cache, block):
        arranged = cache.tile((1, 1, 1, block)).squeeze(3).permute((2, 0, 1))  # (H_kv, num_pages, PAGE)
        arranged.dtype = arranged.dtype.squeeze((0, 1, 2))
        arranged = arranged.tile((1, -1, -1)).squeeze((1, 2))
        arranged.dtype = arranged.dtype.squeeze(0)
        return arranged.unsqueeze(0).unsqueeze(2).expand((batch, -1, new_tokens))

    table = block_table.tile((1, 1))
    table.dtype = table.dtype.squeeze(0)
    table = table.tile((1, -1)).squeeze(1)
    table.dtype = table.dtype.squeeze(0)
    table = table.unsqueeze(1).unsqueeze(2).expand((-1, heads, new_tokens))
    seqlens = cache_seqlens.tile((1,)).unsqueeze(1).unsqueeze(2).expand((-1, heads, new_tokens))
    descales = []
    for x in (k_descale, v_descale):  # (B, H_kv) -> per program its sequence and head's (1,) tile
        arranged = x.tile((1, 1)).unsqueeze(2).expand((-1, -1, new_tokens))
        arranged.dtype = arranged.dtype.squeeze(0)
        descales.append(arranged)
    return (rows(key, block_d), rows(value, block_dv), slots(key_cache, block_d), slots(value_cache, block_dv), table,
            seqlens, num_pages, *descales, QUANTIZE)


def append_application(key, value, key_cache, value_cache, block_table, cache_seqlens, num_pages, k_descale,
                       v_descale, QUANTIZE):
    """Token i of sequence z to position cache_seqlens[z] + i of its pages, as ``_append_kv``
    of the Triton kernel: not written when that position is past the table or its page
    entry lies outside the cache; QUANTIZE, divided by its descales and rounded to e4m3."""
    PAGE = key_cache.shape[1]
    max_pages = block_table.shape[0]
    pos = ntl.sum(cache_seqlens, 0) + key.offsets(2)  # this program's token: its offset along L_new
    fits = (pos >= 0) & (pos < max_pages * PAGE)
    entry = ntl.minimum(ntl.maximum(pos // PAGE, 0), max_pages - 1)
    page = ntl.sum(block_table[entry], 0)
    if fits & (page >= 0) & (page < num_pages):
        if QUANTIZE:
            key_cache[page, pos % PAGE] = _to_e4m3(key, ntl.sum(k_descale, 0))
            value_cache[page, pos % PAGE] = _to_e4m3(value, ntl.sum(v_descale, 0))
        else:
            key_cache[page, pos % PAGE] = key
            value_cache[page, pos % PAGE] = value


def premake_paged(head_dim, head_dim_v, block_m, tile, pages_per_split=None, value_columns=False, block_d=None,
                  block_dv=None):
    """Paged attention over pages in tiles of ``tile`` keys; with ``pages_per_split``, its
    split variant; with ``value_columns``, the variant for value pages stored column-major, the
    value cache given as (num_pages, H_kv, Dv, PAGE) (see ``paged_arrangement``). ``block_d``,
    ``block_dv``: the tiles' widths where the plan widens one (``common.plan.tile_widths``), else
    None for the padded head dims."""
    arrangement_ = functools.partial(
        paged_arrangement, block_m=block_m, tile=tile,
        block_d=block_d if block_d is not None else padded_head_dim(head_dim),
        block_dv=block_dv if block_dv is not None else padded_head_dim(head_dim_v),
        pages_per_split=pages_per_split, value_columns=value_columns,
    )
    split = pages_per_split is not None
    # (fills 0.0, a float: Triton converts no integer to an 8-bit float, and FP8 caches take these loads)
    query = Tensor(shape=(None, None, None, head_dim), other=0.0)
    # (num_pages, PAGE / tile, tile, H_kv, D): each page's keys viewed as tiles (paged_forward)
    key_cache = Tensor(shape=(None, None, tile, None, head_dim), other=0.0)
    num_pages, per_page, _, heads_kv, _ = key_cache.shape
    output = _rows_like(query, *((None,) if split else ()), head_dim_v)
    tensors = (
        query, key_cache,
        # value_cache: as the keys, or (num_pages, H_kv, Dv, PAGE / tile, tile) for column-major pages
        (Tensor(shape=(num_pages, heads_kv, head_dim_v, per_page, tile), other=0.0) if value_columns
         else Tensor(shape=(num_pages, per_page, tile, heads_kv, head_dim_v), other=0.0)),
        _like(query.shape[:1], None, other=0),  # block_table (B, max_pages) int32
        _like(query.shape[:1]),  # cache_seqlens (B,) int32
        _like(query.shape[:1]),  # leftpad (B,) int32
        _like(query.shape[:1]),  # query_lengths (B,) int32
        Tensor(0), Tensor(0), Tensor(0),  # scale, lq_seq, num_pages
        Tensor(0), Tensor(0), Tensor(0),  # band_lo, band_hi, softcap
        _rows_like(query, other=0),  # sinks, (B, H, Lq) float32: a broadcast view of the (H,) logits
        _rows_like(query, other=0),  # slopes, (B, H, Lq) float32: each row's head's slope
        *(_like(query.shape[:1], heads_kv) for _ in range(2)),  # FP8 descales (B, H_kv) of key and value
        output,
        _like(output.shape[:-1]),  # lse ((B, H, Lq) or, split, the partials' (B, H, Lq, S))
        *_flags("BANDED", "WITH_LSE", "DOT_PRECISION", "SPLIT", "TILES_PER_STEP", "JOIN", "JOIN_TILES", "SOFTCAP",
                 "SINKS", "ALIBI", "LEFTPADDED", "QUERY_LENGTHS", "DESCALE", "WIDEN", "VALUE_COLUMNS"),
    )
    return arrangement_, paged_application, tensors


def premake_append(head_dim, head_dim_v):
    """append_kv: the new tokens' keys and values into their slots."""
    arrangement_ = functools.partial(append_arrangement, block_d=padded_head_dim(head_dim),
                                     block_dv=padded_head_dim(head_dim_v))
    key = Tensor(shape=(None, None, None, head_dim))  # (B, H_kv, L_new, D)
    key_cache = Tensor(shape=(None, None, None, head_dim))  # (num_pages, PAGE, H_kv, D)
    tensors = (
        key,
        _like(key.shape[:3], head_dim_v),  # value
        key_cache,
        _like(key_cache.shape[:3], head_dim_v),  # value_cache
        _like(key.shape[:1], None, other=-1),  # block_table (B, max_pages) int32
        _like(key.shape[:1]),  # cache_seqlens (B,) int32
        Tensor(0),  # num_pages
        *(_like(key.shape[:2]) for _ in range(2)),  # FP8 caches' descales (B, H_kv) of key and value
        *_flags("QUANTIZE"),
    )
    return arrangement_, append_application, tensors


def rotary_arrangement(x1, x2, o1, o2, cos, sin, starts, PER_ROW, block_r):
    """One program per (batch, row, head): its pair of (HALF,) slices of x1, x2 and the
    outputs', every row of cos and sin as a (ROWS,) array of (HALF,) tiles (the program picks
    its position's row by index: a gather), its batch entry's start."""
    batch, length, heads = x1.shape[0], x1.shape[1], x1.shape[2]

    def pairs(x):
        arranged = x.tile((1, 1, 1, block_r)).squeeze(3)
        arranged.dtype = arranged.dtype.squeeze((0, 1, 2))
        return arranged

    def angles(table):
        arranged = table.tile((1, block_r)).squeeze(1)  # (ROWS,)
        arranged.dtype = arranged.dtype.squeeze(0)
        arranged = arranged.tile((-1,))  # (1,), the whole array
        return arranged.unsqueeze(1).unsqueeze(2).expand((batch, length, heads))

    starts_arranged = starts.tile((1,)).unsqueeze(1).unsqueeze(2).expand((-1, length, heads))
    return (pairs(x1), pairs(x2), pairs(o1), pairs(o2), angles(cos), angles(sin), starts_arranged, PER_ROW)


def rotary_application(x1, x2, o1, o2, cos, sin, starts, PER_ROW):
    """x1 cos - x2 sin and x1 sin + x2 cos at this row's position (its batch entry's start,
    plus the row where PER_ROW), clamped into the tables, in float32 (as ``_rotary``)."""
    pos = ntl.sum(starts, 0)
    if PER_ROW:
        pos = pos + x1.offsets(1)  # this program's row: its offset along L
    pos = ntl.minimum(ntl.maximum(pos, 0), cos.shape[0] - 1)
    c = ntl.cast(cos[pos], ntl.float32)
    s = ntl.cast(sin[pos], ntl.float32)
    a = ntl.cast(x1, ntl.float32)
    b = ntl.cast(x2, ntl.float32)
    o1 = a * c - b * s  # noqa: F841 (a store)
    o2 = a * s + b * c  # noqa: F841 (a store)


def premake_rotary(half):
    """The rotary embedding of (B, L, H, half) pairs (strided views of one tensor's head dims)."""
    arrangement_ = functools.partial(rotary_arrangement, block_r=padded_head_dim(half))
    x1 = Tensor(shape=(None, None, None, half), other=0)  # (B, L, H, half)
    cos = Tensor(shape=(None, half), other=0)  # (ROWS, half)
    tensors = (
        x1,
        _like(x1.shape[:3], half, other=0),  # x2
        _like(x1.shape[:3], half),  # o1
        _like(x1.shape[:3], half),  # o2
        cos,
        _like(cos.shape[:1], half, other=0),  # sin
        _like(x1.shape[:1]),  # starts (B,) int32
        *_flags("PER_ROW"),
    )
    return arrangement_, rotary_application, tensors
