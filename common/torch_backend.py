"""The "torch" backend: PyTorch's own scaled_dot_product_attention.

The baseline the benchmark and the comparison line up against. It follows the
backend contract (``common.backends``) like the kernel backends, so every tool
treats all three alike; autograd differentiates it natively.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.plan import alibi_bias, band_mask, sdpa_causal
from common.validation import FP8_DTYPES

INTERPRETED = False


def forward(plan):
    """SDPA on a plan's inputs; returns ``(out, None)`` (SDPA gives no log-sum-exp). FP8 inputs
    are dequantized to float32 (stored value times descale), the output cast to the plan's dtype."""
    if plan.descales is not None:
        out, _ = forward(_dequantized(plan))
        return out.to(plan.out_dtype or plan.query.dtype), None
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


def _dequantized(plan):
    """A copy of an FP8 plan with float32 inputs: each FP8 tensor times its descale of (batch,
    key/value head), a query head taking its group's; a floating mask in float32 too."""
    import dataclasses

    def real(t, descale, group=1):
        if t.dtype not in FP8_DTYPES:
            return t.float()
        return t.float() * descale.repeat_interleave(group, dim=1)[:, :, None, None]

    q_descale, k_descale, v_descale = plan.descales
    mask = plan.attn_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    return dataclasses.replace(plan, query=real(plan.query, q_descale, plan.group), key=real(plan.key, k_descale),
                               value=real(plan.value, v_descale), attn_mask=mask, descales=None)
