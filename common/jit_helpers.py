"""The ``@triton.jit`` helpers both backends' kernels call: dropout's mask, tanh, the
soft-cap's factors, the scores (capped or scaled, ALiBi's bias added), a band's test and a band's key-block
stages, FP8 tiles' widening and the P·V order.

The Triton kernels call them as any jit function. NineToothed copies the source of every
``@triton.jit`` function in an application's module into the code it generates, so
``impl_ninetoothed``'s kernels import them by name; under the
interpreter, where they are not JITFunctions, ``impl_ninetoothed.attention._make`` puts
them in each generated module instead. That module imports ``triton`` and
``triton.language`` only, and defining a function evaluates its parameters'
annotations: they say ``triton.language.constexpr``. Their bodies say ``tl`` and name
the constants of ``common.plan`` (``LOG2E``, ``UNIFORM_24``, ``TANH_APPROX``): ``tl.constexpr`` here (a
jit function reads only constexpr globals), defined in each generated module by ``_make``.

Helpers, not plain functions inlined by NineToothed: its inliner gives a value-returning
plain helper, called inside an inlined loop, the same temporary name as the loop
helper's own result (a "loop carried variable changed type" compile error on the GPU).

Importing this module imports ``triton``: only the backends do, after the interpreter's
switch (``common.interpret``), never ``common``'s package.
"""

import triton
import triton.language as tl

from common import plan as _plan

LOG2E = tl.constexpr(_plan.LOG2E)
UNIFORM_24 = tl.constexpr(_plan.UNIFORM_24)
TANH_APPROX = tl.constexpr(int(_plan.Softcap.APPROX))
WIDEN_F16 = tl.constexpr(int(_plan.Widen.FLOAT16))
WIDEN_F16_ROWS = tl.constexpr(int(_plan.Widen.FLOAT16_ROWS))
WIDEN_PV_ORDER = tl.constexpr(int(_plan.Widen.PV_ORDER))


@triton.jit
def _dropout_keep(seed, head, rows, keys, dropout_p):
    """Which scores dropout keeps: (M, N), True where kept, for query rows
    ``rows`` (M,) and keys ``keys`` (N,: consecutive, from a multiple of 4).

    One Philox-4x32-10 draw per four consecutive keys of a row, keyed by the
    64-bit ``seed`` and counted by absolute position (key // 4, row,
    batch·heads + head, 0); its i-th output decides key 4·(key // 4) + i. The
    forward and both backward passes regenerate the same mask from any tiling
    (the dK/dV pass transposes it), and no mask is ever stored. The top 24 bits
    of an output are a uniform in [0, 1); a score is kept when it is >=
    dropout_p. ``common.reference.dropout_keep`` is the same function in plain torch.
    """
    M: tl.constexpr = rows.shape[0]
    N: tl.constexpr = keys.shape[0]
    quads = tl.min(tl.reshape(keys, (N // 4, 4)), 1) // 4  # each run of four keys starts at a multiple of 4
    zero = rows[:, None] * 0 + quads[None, :] * 0  # int32, (M, N / 4)
    r0, r1, r2, r3 = tl.philox(seed, quads[None, :] + zero, rows[:, None] + zero, (head + zero).to(tl.int32), zero)
    # join stacks on a new last axis: [q, a, b] is join(join(r0, r2), join(r1, r3))[q, a, b] = r_(2a + b)
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (M, N))  # output i for key 4q + i
    return (r >> 8).to(tl.float32) * UNIFORM_24 >= dropout_p


@triton.jit
def _tanh(x, APPROX: triton.language.constexpr):
    """tanh(x). APPROX: the GPU's tanh.approx.f32 (one special-function op); otherwise
    1 - 2 / (e^(2x) + 1) from exp2, which saturates to +-1 and runs on every target
    and the interpreter."""
    if APPROX:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        t = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
    return t


@triton.jit
def _cap_factors(scale, softcap, SOFTCAP: triton.language.constexpr):
    """(cap_in, cap_out): soft-capped base-2 scores are tanh(qk * cap_in) * cap_out."""
    cap_in = 0.0
    cap_out = 0.0
    if SOFTCAP:
        cap_in = scale / softcap
        cap_out = softcap * LOG2E
    return cap_in, cap_out


@triton.jit
def _scores(qk, rows, keys, qk_scale, cap_in, cap_out, alibi, alibi_shift,
            SOFTCAP: triton.language.constexpr, ALIBI: triton.language.constexpr):
    """(s, t): the products qk (M, N) as base-2 scores s, soft-capped (SOFTCAP: tanh(qk * cap_in) *
    cap_out, t that tanh, for the backward's 1 - t^2) or scaled (qk * qk_scale, t unused), then ALiBi's
    bias for ``rows`` and ``keys`` added (ALIBI; :func:`_alibi_bias`), before any mask."""
    t = 0.0
    if SOFTCAP:  # softcap * tanh(s / softcap), in base 2
        t = _tanh(qk * cap_in, SOFTCAP == TANH_APPROX)
        s = t * cap_out
    else:
        s = qk * qk_scale
    if ALIBI:
        s = s + _alibi_bias(rows, keys, alibi, alibi_shift)
    return s, t


@triton.jit
def _alibi_bias(rows, keys, slope, shift):
    """(M, N): ALiBi's bias -slope * |rows + shift - keys| for ``rows`` (M,) at positions rows + shift
    (``shift`` a scalar or (M,)) and ``keys`` (N,) (|.| is symmetric: rows and keys swapped, it
    gives the transposed bias); ``slope``: a scalar, or per-row slopes broadcast against (M, N) (an
    (M, 1) column, or a (1, N) row for the transposed bias), in the scores' units (the kernels'
    base 2: the head's slope times log2(e))."""
    return -slope * tl.abs((rows + shift)[:, None] - keys[None, :]).to(tl.float32)


@triton.jit
def _in_band(rows, keys, band_lo, band_hi):
    """(M, N): key j lies in row i's band, i + band_lo <= j <= i + band_hi (band_lo and
    band_hi: scalars, or (M,) vectors of per-row offsets)."""
    return (keys[None, :] >= (rows + band_lo)[:, None]) & (keys[None, :] <= (rows + band_hi)[:, None])


@triton.jit
def _key_stages(rows, lo, hi, Lk, band_lo, band_hi,
                BLOCK_N: triton.language.constexpr, BANDED: triton.language.constexpr):
    """Key-block bounds for these rows within blocks [lo, hi): (first, full_lo,
    full_hi, end): blocks [first, full_lo) and [full_hi, end) need a mask (a band
    edge, or the ragged end of the keys), [full_lo, full_hi) none; no row sees a
    key outside [first, end). (Read with rows and keys swapped, it gives the
    backward's query-block stages for a block of keys.)"""
    end = tl.minimum(hi, tl.cdiv(Lk, BLOCK_N))
    full_hi = Lk // BLOCK_N
    first = lo
    full_lo = lo
    if BANDED:
        first_keys = rows + band_lo
        last_keys = rows + band_hi
        end = tl.minimum(end, tl.cdiv(tl.maximum(tl.minimum(Lk, tl.max(last_keys, 0) + 1), 0), BLOCK_N))
        full_hi = tl.minimum(full_hi, tl.maximum(tl.minimum(Lk, tl.min(last_keys, 0) + 1), 0) // BLOCK_N)
        first = tl.maximum(lo, tl.maximum(tl.min(first_keys, 0), 0) // BLOCK_N)
        full_lo = tl.cdiv(tl.maximum(tl.max(first_keys, 0), 0), BLOCK_N)
    end = tl.maximum(end, first)
    full_lo = tl.minimum(tl.maximum(full_lo, first), end)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
    return first, full_lo, full_hi, end


# What impl_ninetoothed puts in each generated module under the interpreter.
@triton.jit
def _widen(x, WIDEN: triton.language.constexpr):
    """An FP8 tile widened for a 16-bit product (``common.plan.Widen``: to float16, exact for
    e4m3 values), or as it is (Widen.NONE: an FP8 product)."""
    if WIDEN == WIDEN_F16 or WIDEN == WIDEN_F16_ROWS:
        x = x.to(tl.float16)
    return x


@triton.jit
def _p_operand(p, dtype, WIDEN: triton.language.constexpr):
    """P (M, N: float32) as the P·V product's operand: rounded to the values' ``dtype`` and, for
    values in the P·V order (``Widen.PV_ORDER``; N a multiple of 32), its columns put in that order
    (``common.plan.pv_position``): a reshape and a transpose of its axes, which leave each thread's
    registers where the 8-bit operand wants them."""
    p = p.to(dtype)
    if WIDEN == WIDEN_PV_ORDER:
        M: tl.constexpr = p.shape[0]
        N: tl.constexpr = p.shape[1]
        p = tl.reshape(tl.permute(tl.reshape(p, (M, N // 32, 2, 2, 2, 2, 2)), (0, 1, 2, 4, 5, 3, 6)), (M, N))
    return p


@triton.jit
def _pv_rows(x):
    """The rows of tile ``x`` (L, D; L a multiple of 32) put in the P·V order: row l of ``x`` is row
    ``common.plan.pv_position(l)`` of the result (``_p_operand``'s order, on the rows)."""
    L: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    return tl.reshape(tl.permute(tl.reshape(x, (L // 32, 2, 2, 2, 2, 2, D)), (0, 1, 3, 4, 2, 5, 6)), (L, D))


@triton.jit
def _keep_widened(v, cols_ok):
    """A widened FP8 value tile stored row-major (``Widen.FLOAT16_ROWS``) through a select on its
    columns: nothing changes (the columns past the head dim are zeros already), but the compiler can
    no longer move the P·V product's transpose ahead of the widening, where the e4m3 bytes would be
    transposed one by one through shared memory; float16 pairs go through ldmatrix's transposing form."""
    return tl.where(cols_ok[None, :], v, 0.0)


@triton.jit
def _joined_columns(a, b):
    """Tiles ``a`` and ``b`` of the same shape (m, n) as one (m, 2n) tile: a's columns, then b's
    (the NineToothed paged kernel's scores of several pages' tiles, one softmax update)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _joined_rows(a, b, INTERLEAVED: triton.language.constexpr):
    """Tiles ``a`` and ``b`` of the same shape (m, n) as one (2m, n) tile (the NineToothed paged kernel's key and
    value tiles of several pages, one product): a's rows, then b's; or, INTERLEAVED, row 2i a's row i and row
    2i + 1 b's. Interleaved, each thread's neighbouring registers of row-major tiles stay neighbours in the block
    stored for the product, and the stores vectorise (one after the other, they went 2 bytes a store; value
    tiles transposed from column-major pages go the other way). ``_joined_keys`` says which key each row is."""
    if INTERLEAVED:
        return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (2 * a.shape[0], a.shape[1]))
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * a.shape[0], a.shape[1]))


@triton.jit
def _counted_join(x, x_2, x_4, t, g: triton.language.constexpr, ROWS: triton.language.constexpr,
                  INTERLEAVED: triton.language.constexpr):
    """(x, x_2, x_4) after tile ``t``, the g-th of a step's tiles joined in order as a binary counter (the
    NineToothed paged kernel's scores, or key and value tiles): x the group ending at tile g, x_2 and x_4 the pair
    and quad finished before it (at g = 0 any tensors: not read until set). Joined by rows (``_joined_rows``,
    INTERLEAVED or not) or, not ROWS, by columns (``_joined_columns``)."""
    if g % 2 == 0:
        x = t
    else:
        x = _joined_two(x, t, ROWS, INTERLEAVED)
        if g % 4 == 1:
            x_2 = x
        else:
            x = _joined_two(x_2, x, ROWS, INTERLEAVED)
            if g % 8 == 3:
                x_4 = x
            else:
                x = _joined_two(x_4, x, ROWS, INTERLEAVED)
    return x, x_2, x_4


@triton.jit
def _joined_two(a, b, ROWS: triton.language.constexpr, INTERLEAVED: triton.language.constexpr):
    """``_joined_rows(a, b, INTERLEAVED)``, or, not ROWS, ``_joined_columns(a, b)``."""
    if ROWS:
        joined = _joined_rows(a, b, INTERLEAVED)
    else:
        joined = _joined_columns(a, b)
    return joined


@triton.jit
def _joined_keys(rows, TILE, JOIN: triton.language.constexpr, INTERLEAVED: triton.language.constexpr):
    """The key (within a step of JOIN tiles of TILE keys) of each row in ``rows`` of the block that
    ``_joined_rows`` makes of the tiles as a binary counter (pairs, then pairs of pairs): row r itself, or,
    INTERLEAVED, row r // JOIN of tile g, g the bits of r % JOIN reversed (JOIN 1, 2, 4 or 8)."""
    if not INTERLEAVED:
        return rows
    g = rows % JOIN
    if JOIN == 4:
        g = (g % 2) * 2 + g // 2
    if JOIN == 8:
        g = (g % 2) * 4 + (g // 2 % 2) * 2 + g // 4
    return g * TILE + rows // JOIN


@triton.jit
def _half_columns(x, HIGH: triton.language.constexpr):
    """The first (or, HIGH, the second) half of the columns of ``x`` (m, 2n)."""
    low, high = tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))
    if HIGH:
        low = high
    return low


@triton.jit
def _column_piece(x, g: triton.language.constexpr, PIECES: triton.language.constexpr):
    """Columns g·n .. (g + 1)·n of ``x`` (m, PIECES·n), PIECES 1, 2, 4 or 8: halves taken in turn."""
    if PIECES >= 8:
        x = _half_columns(x, (g // 4) % 2)
    if PIECES >= 4:
        x = _half_columns(x, (g // 2) % 2)
    if PIECES >= 2:
        x = _half_columns(x, g % 2)
    return x


@triton.jit
def _narrow_query(q, score_scale, WIDEN: triton.language.constexpr):
    """``(q, score_scale)`` for products with keys widened to float16 (WIDEN_F16): a bfloat16 query
    tile as float16 times 2^-e, e the power of two that brings its largest magnitude into [2^14, 2^15)
    (float16's range, whose 11 significant bits hold bfloat16's 8: exact, but for elements under
    2^-38 of the largest), and score_scale times 2^e; any other tile as it is."""
    if WIDEN == WIDEN_F16 or WIDEN == WIDEN_F16_ROWS:
        if q.dtype == tl.bfloat16:
            big = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
            e = ((big.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141  # 141: float32's bias 127 + 14
            e = tl.minimum(tl.maximum(e, -110), 114)  # (a zero tile: -141; inf or NaN: 114)
            shrink = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e exactly
            q = (q.to(tl.float32) * shrink).to(tl.float16)
            score_scale = score_scale / shrink
    return q, score_scale


@triton.jit
def _sign_unknown(scale, ROWS: triton.language.constexpr):
    """Whether an FP8 call's scores' scale (its descales', a scalar, or ROWS: an (M, 1) column of
    each row's) is not positive in every row. Where it is, a row's largest score is its largest
    product times the scale, taken before scaling (one FMA a score then scales and subtracts it);
    elsewhere the scores are scaled first (real descales are positive: the rare case)."""
    lowest = scale
    if ROWS:
        lowest = tl.min(tl.min(scale, 1), 0)
    return lowest <= 0


@triton.jit
def _to_e4m3(x, descale):
    """x / descale (correctly rounded) as float8_e4m3fn: rounded to nearest even, saturated at
    +-448 (infinities too), NaN kept (``common.quantize_fp8``'s rule)."""
    x = tl.math.div_rn(x.to(tl.float32), descale)
    x = tl.where(x == x, tl.minimum(tl.maximum(x, -448.0), 448.0), x)
    return x.to(tl.float8e4nv)


JIT_HELPERS = (_dropout_keep, _tanh, _cap_factors, _scores, _alibi_bias, _in_band, _key_stages, _widen,
               _keep_widened, _narrow_query, _sign_unknown, _to_e4m3, _joined_columns, _joined_rows, _joined_keys,
               _counted_join, _joined_two, _half_columns, _column_piece, _p_operand, _pv_rows)
