"""``attention()``: the one public entry point of both kernels (and of SDPA)."""

from __future__ import annotations

import torch

from common.backends import resolve
from common.splitkv import pack_gqa
from common.validation import check_call


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    backend: str | None = None,
    return_lse: bool = False,
):
    """Scaled-dot-product attention, as ``torch.nn.functional.scaled_dot_product_attention``.

    ``softmax(query @ key.T * scale + mask) @ value``, computed by the chosen
    backend without materialising the score matrix.

    Args:
        query: (B, H, Lq, D) or (H, Lq, D); float16, bfloat16 or float32; any strides.
        key: (B, H_kv, Lk, D) or (H_kv, Lk, D); same dtype and device as query.
        value: (B, H_kv, Lk, Dv) or (H_kv, Lk, Dv); Dv may differ from D.
            The Triton backends take head dims 16 <= D, Dv <= 256.
        is_causal: mask with SDPA's top-left alignment, ``ones(Lq, Lk).tril(0)``:
            query row i sees keys 0..i, also when Lq != Lk.
        scale: multiplies the scores; None means 1/sqrt(D). Any finite float.
        attn_mask: None; a bool tensor (True = takes part); or a float tensor
            (float32 or query's dtype) added to the scaled scores. Broadcastable
            to (B, H, Lq, Lk); read through its strides, never copied. Not
            together with is_causal (SDPA rejects that pair too). A row whose
            every key is masked out gives 0, as SDPA does.
        dropout_p: only 0.0 is supported.
        enable_gqa: allow H_kv < H (grouped-query / multi-query attention); H
            must be a multiple of H_kv; query head h reads K/V head h // (H // H_kv).
        backend: "triton", "ninetoothed" or "torch" (SDPA itself). When None:
            the innermost ``use_backend(...)`` block, else the environment
            variable ATTENTION_BACKEND, else "triton".
        return_lse: also return the natural-log log-sum-exp of each query row's
            scaled, masked scores: float32, shape (B, H, Lq) or (H, Lq); -inf
            for a row whose every key is masked out.

    Returns:
        The output, (B, H, Lq, Dv) or (H, Lq, Dv), in the inputs' dtype; with
        ``return_lse=True`` the pair ``(output, lse)``.

    Raises:
        TypeError, ValueError: for bad input, before any kernel launches. The
        Triton backends have no backward pass: inputs that require grad (with
        grad enabled) are rejected rather than given an output with no
        gradient path.
    """
    chosen = resolve(backend)
    call = check_call(
        chosen, query, key, value,
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
    )
    q, k, v = call.query, call.key, call.value
    B, H, Lq, _ = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    if B * H * Lq == 0 or Lk == 0:
        # Nothing to launch. With no keys at all SDPA returns zeros (and the
        # log-sum-exp of an empty set is -inf).
        out = q.new_zeros((B, H, Lq, Dv))
        lse = q.new_full((B, H, Lq), float("-inf"), dtype=torch.float32) if call.return_lse else None
    else:
        mask, packed = call.attn_mask, None
        if chosen.uses_triton:
            if call.is_causal and Lk > Lq:
                # Top-left alignment: no row sees a key past Lq - 1. Dropping them
                # (views) keeps split launches from planning work for them.
                k, v = k[:, :, :Lq], v[:, :, :Lq]
            packed = pack_gqa(q, k, mask, call.is_causal)
            if packed is not None:
                # Each group's query heads as rows of one K/V head (views both ways).
                q, mask = packed
        out, lse = chosen.load().forward(
            q, k, v, is_causal=call.is_causal, scale=call.scale,
            attn_mask=mask, return_lse=call.return_lse,
        )
        if packed is not None:
            out = out.view(B, H, Lq, Dv)
            lse = lse.view(B, H, Lq) if lse is not None else None
    if call.unbatched:
        out = out[0]
        lse = lse[0] if lse is not None else None
    return (out, lse) if call.return_lse else out
