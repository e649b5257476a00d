"""The "torch" backend: PyTorch's own scaled_dot_product_attention.

The baseline the benchmark and the comparison line up against. It shares the
other backends' launcher contract so that every tool treats all three alike.
"""

from __future__ import annotations

import torch.nn.functional as F


def forward(query, key, value, *, is_causal: bool, scale: float, attn_mask=None, return_lse: bool = False):
    """SDPA on validated inputs; returns ``(out, None)`` (it has no log-sum-exp to give)."""
    if return_lse:  # common.validation rejects this before we get here
        raise ValueError("the 'torch' backend cannot return the log-sum-exp")
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out, None
