"""The "torch" backend: PyTorch's own scaled_dot_product_attention.

The baseline the benchmark and the comparison line up against. It follows the
backend contract (``common.backends``) like the kernel backends, so every tool
treats all three alike; autograd differentiates it natively.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.plan import alibi_bias, band_mask, sdpa_causal

INTERPRETED = False


def forward(plan):
    """SDPA on a plan's inputs; returns ``(out, None)`` (SDPA gives no log-sum-exp)."""
    attn_mask, is_causal = plan.attn_mask, plan.is_causal
    Lq, Lk = plan.query.shape[2], plan.key.shape[2]
    if plan.band is not None and not (attn_mask is None and plan.alibi is None and sdpa_causal(plan.band, Lq)):
        # a window or bottom-right causal: SDPA takes them as a mask (which sends it
        # to a slower kernel than is_causal does: only where is_causal cannot say it)
        allowed = band_mask(plan.band, Lq, Lk, plan.query.device)
        if attn_mask is None:
            attn_mask = allowed
        elif attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & allowed
        else:
            attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
        is_causal = False
    elif plan.band is not None:
        is_causal = True
    if plan.alibi is not None:
        # ALiBi's bias as an additive float32 mask, with the mask and band above folded in
        # (where(bool), or a sum); a None band means every row sees every key: no is_causal
        bias = alibi_bias(plan.alibi, plan.alibi_shift, Lk)
        if attn_mask is None:
            attn_mask = bias
        elif attn_mask.dtype == torch.bool:
            attn_mask = bias.masked_fill(~attn_mask, float("-inf"))
        else:
            attn_mask = attn_mask.float() + bias
        is_causal = False
    out = F.scaled_dot_product_attention(
        plan.query, plan.key, plan.value, attn_mask=attn_mask, is_causal=is_causal, scale=plan.scale,
        enable_gqa=plan.group > 1, dropout_p=plan.dropout_p,
    )
    return out, None
