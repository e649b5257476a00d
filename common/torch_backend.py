"""The "torch" backend: PyTorch's own scaled_dot_product_attention.

The baseline the benchmark and the comparison line up against. It follows the
backend contract (``common.backends``) like the kernel backends, so every tool
treats all three alike; autograd differentiates it natively.
"""

from __future__ import annotations

import torch.nn.functional as F

INTERPRETED = False


def forward(plan):
    """SDPA on a plan's inputs; returns ``(out, None)`` (SDPA gives no log-sum-exp)."""
    out = F.scaled_dot_product_attention(
        plan.query, plan.key, plan.value, attn_mask=plan.attn_mask, is_causal=plan.is_causal, scale=plan.scale,
        enable_gqa=plan.group > 1, dropout_p=plan.dropout_p,
    )
    return out, None
