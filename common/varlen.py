"""Packed variable-length batches: ``varlen_attention``, FlashAttention's varlen interface.

Sequences of different lengths are packed one after another along the token
dim, with no padding; ``cu_seqlens_q`` and ``cu_seqlens_k`` (int32, B + 1 prefix
sums from 0) say where each starts. The kernels see the packed tensors as one
(1, H, total, D) batch in which every query row has its own band of keys
(``row_bands``): the keys of its own sequence, cut by causality, alignment and
window. Row blocks then visit only the key blocks their rows' bands reach, and
blocks wholly inside every row's band run unmasked, as for a dense call.
"""

from __future__ import annotations

import numbers

import torch

from common import ops
from common.backends import resolve
from common.configs import padded_head_dim
from common.dispatch import _needs_grad
from common.validation import check_call, check_slopes


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    backend: str | None = None,
    return_lse: bool = False,
    alignment: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Attention over a packed batch of variable-length sequences, each on its own.

    Sequence b's queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of
    ``query`` and attend only to keys ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``
    of ``key`` and ``value``, exactly as :func:`common.attention` would on that
    sequence alone.

    Args:
        query: (total_q, H, D); float16, bfloat16 or float32; any strides. Or
            float8_e4m3fn (forward only; see q_descale).
        key: (total_k, H_kv, D); value: (total_k, H_kv, Dv); same dtype and device (FP8:
            float8_e4m3fn keys and values under an FP8 or a float16/bfloat16 query).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) on the inputs' device: 0, then
            the running totals of the sequences' lengths (empty sequences welcome);
            the last entries must be total_q and total_k.
        max_seqlen_q, max_seqlen_k: ints >= 0, the longest sequence's lengths, or
            bounds on them (FlashAttention's signature). The kernels read each row's keys
            from the cumulative lengths; a batch of short query sequences (decoding) is laid
            out per sequence, max_seqlen_q rows each, so that a row block walks one
            sequence's keys: there a sequence longer than max_seqlen_q gives NaN in its rows
            past it (no host sync checks it). The "torch" backend pads to both and checks
            them, with a host sync.
        is_causal, alignment, window, softcap: as for :func:`common.attention`,
            per sequence: with "top_left" query row i of a sequence sits at
            position i, with "bottom_right" at i + Lk_b - Lq_b.
        scale: None (1/sqrt(D)) or any finite float.
        enable_gqa: allow H_kv < H, H a multiple of H_kv.
        backend: "triton", "ninetoothed" or "torch" (SDPA on the sequences padded
            to max_seqlen_q and max_seqlen_k, each row's keys as a boolean mask).
        return_lse: also return the log-sum-exp, float32 (H, total_q).
        dropout_p, dropout_seed: as for :func:`common.attention`; the kernel backends
            draw each weight's keep/drop from Philox counted by its packed position
            (row and key in the packed batch), so a seed gives the same mask again.
        sinks: None, or (H,): one logit per query head in every row's softmax, as for
            :func:`common.attention` (kernel backends; differentiable).
        alibi_slopes: None, or float32 (H,) or (B, H) (per sequence) on the inputs' device: ALiBi,
            the bias -slope * |position_i - j| on the score of row i and key j of a sequence,
            position_i as ``alignment`` places it (FlashAttention's: bottom-right). Not differentiated.
        q_descale, k_descale, v_descale, out_dtype: FP8 inputs' descales and an FP8 query's
            output dtype, as for :func:`common.attention` but one descale per sequence and
            key/value head: float32 (B, H_kv) (FlashAttention-3's varlen convention), None for 1.
            Each row's scores take its sequence's query and key descales, its output its
            sequence's value descale (a row's keys are its own sequence's). Forward only.

    Returns:
        The output (total_q, H, Dv) in the query's dtype (an FP8 query's: ``out_dtype``, bfloat16
        by default), a transposed view of the kernels' (H, total_q, Dv) buffer (``reshape``, not
        ``view``, merges heads); with ``return_lse``,
        ``(output, lse)``. Differentiable in query, key and value. A row whose
        sequence has no key gives 0.

    No host synchronisation: the lengths stay on the device, and the lengths
    themselves are not checked against the totals (that would need one). Lengths
    that do not add up give wrong rows, never reads outside the tensors: each
    row's keys are clamped to the packed key range.

    Raises:
        TypeError, ValueError: for bad input, before any kernel launches.
    """
    _check_packed(query, key, value)
    cu_q, cu_k = _check_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, query, key)
    chosen = resolve(backend)
    num_seqs = cu_q.numel() - 1
    call = check_call(
        chosen, *(t.transpose(0, 1).unsqueeze(0) for t in (query, key, value)),
        attn_mask=None, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        return_lse=return_lse, dropout_seed=dropout_seed, alignment=alignment, window=window, softcap=softcap,
        sinks=sinks, fp8=(q_descale, k_descale, v_descale, out_dtype), sequences=num_seqs,
    )
    _, H, total_q, _ = call.query.shape
    total_k = call.key.shape[2]
    if alibi_slopes is not None:  # (each row its sequence's slope and position: per-row ALiBi)
        call.alibi_slopes, call.alibi_shifts = alibi_rows(
            check_slopes(alibi_slopes, num_seqs, "sequence", H, call.query.device), cu_q, cu_k, total_q, total_k,
            bottom_right=call.bottom_right)
    rows_per_seq = _rows_per_sequence(chosen, call, num_seqs, max_seqlen_q) if chosen.kernels else None
    bands = row_bands(cu_q, cu_k, total_q, total_k, is_causal=call.is_causal, window=call.window,
                      bottom_right=call.bottom_right, rows_per_seq=rows_per_seq)
    call.is_causal, call.window, call.bottom_right = False, None, False  # all in the bands now
    if not chosen.kernels:
        return _padded_reference(chosen, call, cu_q, cu_k, bands, max_seqlen_q, max_seqlen_k)
    call.row_bands = bands
    if rows_per_seq is not None:  # each sequence's queries from a row block's start on
        slots = cu_q[:-1].long()[:, None] + torch.arange(rows_per_seq, device=cu_q.device)
        call.query = call.query[:, :, slots.flatten().clamp(max=total_q - 1)]
    if call.descales is not None:  # each kernel row its sequence's descales
        call.descales = descale_rows(call.descales, cu_q, total_q, H, rows_per_seq)
    if call.dropout_p > 0.0 and call.dropout_seed is None:
        call.dropout_seed = ops.new_seed(call.query.device)
    if call.descales is not None and torch.compiler.is_compiling():
        # forward only (validated): the operator itself, without autograd's Function
        out, lse = ops.OPS[chosen.name][0](call.query, call.key, call.value, None, False, call.scale,
                                           call.dropout_p, call.dropout_seed, *ops.extras(call), call.sinks,
                                           call.row_bands, call.alibi_slopes, call.alibi_shifts, *call.descales,
                                           call.out_dtype)
    elif torch.compiler.is_compiling() or _needs_grad(call):
        out, lse = ops.FUNCTIONS[chosen.name].apply(call.query, call.key, call.value, None, False, call.scale,
                                                    call.dropout_p, call.dropout_seed, *ops.extras(call),
                                                    call.sinks, call.row_bands, call.alibi_slopes, call.alibi_shifts)
    else:
        out, lse = ops.forward(chosen, call, with_lse=call.return_lse)
    out, lse = out[0], lse[0] if call.return_lse else None  # (H, rows, Dv), (H, rows)
    if rows_per_seq is not None:
        out, lse = _packed_rows(out, lse, cu_q, total_q, rows_per_seq)
    out = out.transpose(0, 1)
    return (out, lse) if call.return_lse else out


# A packed batch whose sequences average fewer query rows than this runs per sequence (decoding,
# speculative decoding, chunks of a few tokens: a row block of the packed layout would hold the rows of
# several sequences and walk all of their keys) where each sequence's rows fit one row block, or the
# padding stays within PADDING_LIMIT times the packed rows.
SHORT_QUERIES = 64
PADDING_LIMIT = 16


def _rows_per_sequence(backend, call, num_seqs: int, max_seqlen_q: int) -> int | None:
    """The kernels' query rows per sequence when a packed batch is laid out per sequence (its
    queries from row b * rows, rows a multiple of the forward's row block, so that no row block
    holds two sequences' rows and each walks only its own sequence's keys), or None to keep the
    packed layout. Forward and backward, with every feature but dropout (its draws are counted by
    packed position) and ALiBi (its per-row slopes and shifts are the packed rows')."""
    total_q, total_k = call.query.shape[2], call.key.shape[2]
    if (num_seqs < 2 or max_seqlen_q == 0 or total_q == 0 or total_q >= SHORT_QUERIES * num_seqs
            or call.dropout_p > 0.0 or call.alibi_slopes is not None):
        return None
    rows = block_m = -(-max_seqlen_q // 16) * 16
    if not torch.compiler.is_compiling():  # (the config table is not for a graph to read: there a row
        # block may hold the rows of a few sequences, a multiple of 16 each)
        block_d = max(padded_head_dim(call.query.shape[3]), padded_head_dim(call.value.shape[3]))
        block_m = backend.configs.lookup(block_d, call.query.dtype, False, num_seqs * rows, total_k,
                                         backend.interpreted()).block_m
        rows = -(-max_seqlen_q // block_m) * block_m
    # (a row block per sequence is what attending per sequence takes; past it, the padding is bounded)
    return rows if rows <= max(block_m, 64) or num_seqs * rows <= PADDING_LIMIT * total_q else None


def _packed_rows(out, lse, cu_q, total_q: int, rows_per_seq: int):
    """The kernels' per-sequence rows (H, B * rows_per_seq, ...) back in packed order (H, total_q,
    ...). A row past max_seqlen_q (a maximum below its sequence's length: nothing computed it) is
    NaN, and its lse too: never a silent 0."""
    packed = torch.arange(total_q, device=cu_q.device, dtype=torch.int32)
    seq = (torch.searchsorted(cu_q, packed, right=True) - 1).clamp_(0, cu_q.numel() - 2)
    index = packed - cu_q[seq]
    computed = index < rows_per_seq
    slot = seq * rows_per_seq + index.clamp(max=rows_per_seq - 1)
    out = torch.where(computed[:, None], out[:, slot], float("nan"))
    if lse is not None:
        lse = torch.where(computed, lse[:, slot], float("nan"))
    return out, lse


def _padded_reference(backend, call, cu_q, cu_k, bands, max_q: int, max_k: int) -> torch.Tensor:
    """The torch backend: SDPA on the sequences padded to (B, H, max_seqlen, D), each row's
    band a (B, 1, max_q, max_k) boolean mask (B·max_q·max_k bools where one block-diagonal
    mask would take total_q·total_k), the rows gathered back. Padding needs the maxima to
    hold: one host sync checks them (the kernel backends need no maxima and no sync)."""
    q, k, v = call.query[0], call.key[0], call.value[0]  # (H, total, D)
    H, total_q = q.shape[:2]
    total_k = k.shape[1]
    B = cu_q.numel() - 1
    if B:
        longest = torch.stack([(cu_q[1:] - cu_q[:-1]).max(), (cu_k[1:] - cu_k[:-1]).max()]).tolist()
        for name, length, given in zip(("max_seqlen_q", "max_seqlen_k"), longest, (max_q, max_k)):
            if length > given:
                raise ValueError(f"{name} is {given} but a sequence has {length} tokens: the maxima must "
                                 "hold every sequence (the 'torch' backend pads to them)")
    if total_q == 0 or total_k == 0 or max_q == 0 or max_k == 0:  # no row sees a key: zeros
        return q.new_zeros((total_q, H, v.shape[2]), dtype=call.out_dtype or q.dtype)
    device = q.device

    def slots(cu, total, max_len):  # (B, max_len): each padded slot's packed index, and whether it is real
        index = cu[:-1].long()[:, None] + torch.arange(max_len, device=device)[None, :]
        return index.clamp(0, total - 1), index < cu[1:].long()[:, None]

    rows, real_rows = slots(cu_q, total_q, max_q)
    keys, real_keys = slots(cu_k, total_k, max_k)
    first, last = rows + bands[0, rows], rows + bands[1, rows]  # each row's packed keys
    allowed = (real_rows[:, :, None] & real_keys[:, None, :]
               & (keys[:, None, :] >= first[:, :, None]) & (keys[:, None, :] <= last[:, :, None]))
    call.query, call.key, call.value = (t[:, index].transpose(0, 1) for t, index in ((q, rows), (k, keys), (v, keys)))
    call.attn_mask = allowed[:, None].expand(B, H, max_q, max_k)
    if call.alibi_slopes is not None:  # the per-row bias in the padded layout, the band's -inf folded in
        distance = (rows + call.alibi_shifts[rows])[:, :, None] - keys[:, None, :]  # (B, max_q, max_k)
        bias = -call.alibi_slopes[0][:, rows].transpose(0, 1)[..., None] * distance.abs()[:, None].float()
        call.attn_mask = bias.masked_fill(~call.attn_mask, float("-inf"))
        call.alibi_slopes = call.alibi_shifts = None
    out, _ = ops.forward(backend, call, with_lse=False)  # (B, H, max_q, Dv)
    packed = torch.arange(total_q, device=device, dtype=torch.int32)
    seq = (torch.searchsorted(cu_q, packed, right=True) - 1).clamp_(0, B - 1)
    position = (packed - cu_q[seq]).clamp_(0, max_q - 1)
    return out[seq, :, position]  # (total_q, H, Dv)


def descale_rows(descales, cu_seqlens_q, total_q: int, H: int, rows_per_seq: int | None) -> tuple:
    """FP8 descales of a packed batch, (B, H_kv) each (None for 1), as the kernels read them per row:
    float32 (1, H, rows), each kernel row its sequence's and its query head's K/V head's. Rows are
    the packed ones (total_q), or ``rows_per_seq`` slots a sequence where the batch is laid out per
    sequence. On the device (no host sync)."""
    device = cu_seqlens_q.device
    num_seqs = cu_seqlens_q.numel() - 1
    if rows_per_seq is not None:
        seq = torch.arange(num_seqs, device=device).repeat_interleave(rows_per_seq)
    else:
        rows = torch.arange(total_q, device=device, dtype=torch.int32)
        seq = (torch.searchsorted(cu_seqlens_q, rows, right=True) - 1).clamp_(0, max(num_seqs - 1, 0))

    def per_row(d):
        return d[seq].repeat_interleave(H // d.shape[1], dim=1).transpose(0, 1)[None]

    return tuple(None if d is None else per_row(d) for d in descales)


def alibi_rows(slopes, cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, *, bottom_right: bool):
    """ALiBi per packed row, as the kernels take it: each row's slope, float32 (1, H, total_q)
    (its sequence's, a view where the slopes are per head), and its position shift, int32
    (total_q,): row r of sequence b sits at packed key r + shift, its position in the
    sequence's keys (bottom-right: Lk_b - Lq_b past its index among the queries). On the device."""
    device = cu_seqlens_q.device
    cu_q = cu_seqlens_q.long().clamp(0, total_q)
    cu_k = cu_seqlens_k.long().clamp(0, total_k)
    rows = torch.arange(total_q, device=device, dtype=torch.int32)
    seq = (torch.searchsorted(cu_seqlens_q, rows, right=True) - 1).clamp_(0, max(cu_q.numel() - 2, 0))
    shift = cu_k[seq] - cu_q[seq]
    if bottom_right:
        shift = shift + (cu_k[seq + 1] - cu_k[seq]) - (cu_q[seq + 1] - cu_q[seq])
    H = slopes.shape[-1]
    per_row = (slopes[:, None].expand(H, total_q) if slopes.ndim == 1 else slopes[seq].transpose(0, 1))[None]
    return per_row, shift.to(torch.int32)


def _check_packed(query, key, value) -> None:
    """Packed tensors, 3-D (the rest of their checks are :func:`common.attention`'s)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim), got shape {tuple(t.shape)}")


def _check_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, query, key):
    """The sequences' lengths: two cumulative-length tensors of as many sequences, and the
    maxima as ints. Returns the cumulative lengths."""
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, query)
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, query)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got "
                         f"{cu_q.numel() - 1} and {cu_k.numel() - 1}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise TypeError(f"{name} must be an int >= 0, got {n!r}")
    if cu_q.numel() == 1 and (query.shape[0] or key.shape[0]):
        raise ValueError("cu_seqlens_q and cu_seqlens_k describe no sequence, but query or key holds tokens")
    return cu_q, cu_k


def _check_cu_seqlens(name: str, cu: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {str(cu.dtype).removeprefix('torch.')}")
    if cu.ndim != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with B + 1 >= 1 entries, got shape {tuple(cu.shape)}")
    if cu.device != query.device:
        raise ValueError(f"{name} is on {cu.device} but query is on {query.device}")
    return cu


def row_bands(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, *, is_causal: bool, window,
              bottom_right: bool, rows_per_seq: int | None = None) -> torch.Tensor:
    """Each packed row's keys and each packed key's rows, as the kernels' ROW_BANDS take them:
    int32 (2, rows + total_k). Columns 0..rows-1: row i sees keys i + [0][i] ..
    i + [1][i]; columns rows + j: key j is seen by rows j + [0][.] .. j + [1][.].
    The rows are the packed queries (rows = total_q) or, with ``rows_per_seq``, the queries laid
    out per sequence (rows = B * rows_per_seq, sequence b's from row b * rows_per_seq on, the
    rows past its length padding that sees no key; see :func:`_rows_per_sequence`).
    Computed on the device (no host sync); lengths are clamped into the packed ranges."""
    device = cu_seqlens_q.device
    cu_q = cu_seqlens_q.long().clamp(0, total_q)
    cu_k = cu_seqlens_k.long().clamp(0, total_k)
    last_seq = max(cu_q.numel() - 2, 0)
    n_rows = total_q if rows_per_seq is None else (cu_q.numel() - 1) * rows_per_seq
    left, right = window if window is not None else (-1, -1)
    bands = torch.empty(2, n_rows + total_k, dtype=torch.int32, device=device)

    def ends(seq):
        q0, q1, k0, k1 = cu_q[seq], cu_q[seq + 1], cu_k[seq], cu_k[seq + 1]
        shift = (k1 - k0) - (q1 - q0) if bottom_right else 0  # a row's position = its index in the sequence + shift
        if rows_per_seq is not None:  # (the sequence's rows start at its slot)
            q0, q1 = seq * rows_per_seq, seq * rows_per_seq + (q1 - q0)
        return q0, q1, k0, k1, shift

    def sequence(index, cu):
        # (searched in the caller's int32 lengths themselves: Inductor cannot lower a
        # search in a slice of a computed tensor)
        return (torch.searchsorted(cu, index, right=True) - 1).clamp_(0, last_seq)

    rows = torch.arange(n_rows, device=device, dtype=torch.int32)
    q0, q1, k0, k1, shift = ends(sequence(rows, cu_seqlens_q) if rows_per_seq is None
                                 else (rows // rows_per_seq).long().clamp_(0, last_seq))
    key_of_row = k0 + rows - q0 + shift  # the key at the row's position
    first, last = k0, k1 - 1
    if left >= 0:
        first = torch.maximum(first, key_of_row - left)
    if is_causal:
        last = torch.minimum(last, key_of_row)
    if right >= 0:
        last = torch.minimum(last, key_of_row + right)
    if rows_per_seq is not None:  # padding rows (past their sequence's queries) see no key
        last = torch.where(rows < q1, last, first - 1)
    bands[0, :n_rows] = first - rows
    bands[1, :n_rows] = last - rows

    keys = torch.arange(total_k, device=device, dtype=torch.int32)
    q0, q1, k0, k1, shift = ends(sequence(keys, cu_seqlens_k))
    row_of_key = q0 + keys - k0 - shift  # the row whose position is the key's
    first, last = q0, q1 - 1
    if is_causal:
        first = torch.maximum(first, row_of_key)
    if right >= 0:
        first = torch.maximum(first, row_of_key - right)
    if left >= 0:
        last = torch.minimum(last, row_of_key + left)
    bands[0, n_rows:] = first - keys
    bands[1, n_rows:] = last - keys
    return bands
