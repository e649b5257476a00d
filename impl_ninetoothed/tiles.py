"""Arranging tiles: the building blocks of the NineToothed kernels' arrangements
(``impl_ninetoothed.kernels``, ``impl_ninetoothed.paged_kernels``), plain Python on
symbolic tensors, run once per ``ninetoothed.make``.
"""

from __future__ import annotations

# -- arranging tiles (plain Python on symbolic tensors, run once per make) ---------------

def _rows(x, block_m, block_d):
    """(B, H, L, D) -> programs (B, H, L / BLOCK_M), each a (BLOCK_M, D) tile."""
    arranged = x.tile((1, 1, block_m, block_d)).squeeze(3)
    arranged.dtype = arranged.dtype.squeeze((0, 1))
    return arranged


def _row_slices(x, block_m):
    """(B, H, L) -> programs (B, H, L / BLOCK_M), each a (BLOCK_M,) slice."""
    arranged = x.tile((1, 1, block_m))
    arranged.dtype = arranged.dtype.squeeze((0, 1))
    return arranged


def _group(heads, kv_heads):
    """Query heads per K/V head: 1 where the K/V heads are the query's own size symbol (a kernel whose
    keys share the query's (B, H): no division to unravel), else ``heads // kv_heads``."""
    return 1 if kv_heads is heads else heads // kv_heads


def _key_row(x, heads, m_blocks, block_n, block_d, blocks_per_split=None):
    """(B, H_kv, Lk, D) -> per program of (B, heads, m_blocks[, S]), the row of
    (BLOCK_N, D) tiles of the K/V head its query head reads (split: its split's
    part of that row, ``blocks_per_split`` tiles: an int, or a symbol of
    :func:`_split_blocks`). Query head h reads K/V head h // GROUP, so the H_kv
    heads are repeated GROUP times by broadcasting (expand), never by copying."""
    group = _group(heads, x.shape[1])
    arranged = x.tile((1, 1, block_n, block_d))
    if blocks_per_split is None:
        arranged = arranged.tile((1, 1, -1, -1)).squeeze((2, 3))  # (B, H_kv)
        arranged = arranged.unsqueeze(2).unsqueeze(3)
        arranged = arranged.expand((-1, -1, group, m_blocks)).flatten(1, 3)
    else:
        arranged = arranged.tile((1, 1, blocks_per_split, -1)).squeeze(3)  # (B, H_kv, S)
        arranged = arranged.unsqueeze(2).unsqueeze(3)
        arranged = arranged.expand((-1, -1, group, m_blocks, -1)).flatten(1, 3)
    arranged.dtype = arranged.dtype.squeeze((0, 1, 3))
    arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1))
    return arranged


def _key_blocks_row(x, heads, m_blocks, block_d, num_splits=None):
    """(B, H_kv, Lk // BLOCK_N, BLOCK_N, D), the keys' whole blocks as a dimension of their own
    (a view, see ``blocked_keys``) -> per program of (B, heads, m_blocks), the row of
    (BLOCK_N, D) tiles of its K/V head, as :func:`_key_row`; with ``num_splits`` (a split
    launch, which reads none of them) the same row for each split."""
    group = _group(heads, x.shape[1])
    arranged = x.tile((1, 1, 1, x.shape[3], block_d)).tile((1, 1, -1, -1, -1)).squeeze((2, 3, 4))  # (B, H_kv)
    arranged = arranged.unsqueeze(2).unsqueeze(3)
    arranged = arranged.expand((-1, -1, group, m_blocks)).flatten(1, 3)
    if num_splits is not None:
        arranged = arranged.unsqueeze(2).expand((-1, -1, num_splits))
    arranged.dtype = arranged.dtype.squeeze((0, 1, 3, 4))
    arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1, 2))
    return arranged


def _per_kv_head(x, heads, m_blocks, num_splits=None):
    """(B, H_kv), a value per K/V head -> per program of (B, heads, m_blocks[, S]), the (1,) tile
    of the K/V head its query head reads (h // GROUP), repeated by broadcasting as :func:`_key_row`."""
    group = _group(heads, x.shape[1])
    arranged = x.tile((1, 1))  # (B, H_kv)
    arranged = arranged.unsqueeze(2).unsqueeze(3)
    arranged = arranged.expand((-1, -1, group, m_blocks)).flatten(1, 3)
    if num_splits is not None:
        arranged = arranged.unsqueeze(2).expand((-1, -1, num_splits))
    arranged.dtype = arranged.dtype.squeeze(0)
    return arranged


def _group_row_blocks(x, group, n_blocks, block_d=None):
    """(B, H, Lq // BLOCK_M, BLOCK_M[, D]), the rows' whole blocks as a dimension of their own
    (a view) -> per program of (B, H_kv, n_blocks), the (GROUP, Lq // BLOCK_M) tiles of
    (BLOCK_M[, D]) of the query heads that read K/V head h_kv, as :func:`_group_rows`."""
    if block_d is None:
        arranged = x.tile((1, 1, 1, x.shape[3])).tile((1, group, -1, -1)).squeeze((2, 3))
        arranged.dtype = arranged.dtype.squeeze((0, 3))
        arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1, 2))
    else:
        arranged = x.tile((1, 1, 1, x.shape[3], block_d)).tile((1, group, -1, -1, -1)).squeeze((2, 3, 4))
        arranged.dtype = arranged.dtype.squeeze((0, 3, 4))
        arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1, 2))
    return arranged.unsqueeze(2).expand((-1, -1, n_blocks))


def _mask_row(attn_mask, block_m, block_n, blocks_per_split=None):
    """(B, H, Lq, Lk), broadcast views welcome -> per program a row of
    (BLOCK_M, BLOCK_N) tiles (split: BLOCKS_PER_SPLIT of them)."""
    arranged = attn_mask.tile((1, 1, block_m, block_n))
    arranged = arranged.tile((1, 1, 1, blocks_per_split if blocks_per_split is not None else -1))
    if blocks_per_split is None:
        arranged = arranged.squeeze(3)
    arranged.dtype = arranged.dtype.squeeze((0, 1, 2))
    arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1))
    return arranged


def _last_first(arranged):
    """Programs (B, H, M[, ...]) -> the same with the row blocks last to first (a causal row
    block's work grows with its index: the longest start first, as in the Triton kernel)."""
    return arranged[:, :, ::-1]


def _split_blocks(key, num_splits, block_n):
    """The key blocks of each split, as the plan makes them (``common.plan.Planner.splits``):
    ceil(ceil(Lk / BLOCK_N) / S), in symbols of the keys' length and the partials' split count,
    so that one compiled kernel serves every split size (a tile size of the arrangement; a
    Python int here would be a kernel per value, compiled as a decode loop's cache grows)."""
    k_blocks = (key.shape[2] + (block_n - 1)) // block_n
    return (k_blocks + (num_splits - 1)) // num_splits


def _per_split(arranged, num_splits):
    """The same tile for each of the S programs of a row block: (B, H, M) -> (B, H, M, S)."""
    return arranged.unsqueeze(3).expand((-1, -1, -1, num_splits))


def _per_program(dropout_seed, arranged):
    """The dropout seed, a (1,) tensor, as the same (1,) tile for every program of ``arranged``'s grid."""
    tiled = dropout_seed.tile((1,))
    for _ in range(len(arranged.shape) - 1):
        tiled = tiled.unsqueeze(0)
    return tiled.expand(tuple(arranged.shape))


def _group_rows(x, group, n_blocks, block_m, block_d=None):
    """(B, H, L[, D]) -> per program of (B, H_kv, n_blocks), the (GROUP, L / BLOCK_M)
    tiles of (BLOCK_M[, D]) of the query heads that read K/V head h_kv."""
    if block_d is None:
        arranged = x.tile((1, 1, block_m)).tile((1, group, -1)).squeeze(2)
        arranged.dtype = arranged.dtype.squeeze(0)
    else:
        arranged = x.tile((1, 1, block_m, block_d)).tile((1, group, -1, -1)).squeeze((2, 3))
        arranged.dtype = arranged.dtype.squeeze((0, 3))
    arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1))
    return arranged.unsqueeze(2).expand((-1, -1, n_blocks))
