"""FP8 inputs: quantizing a tensor to float8_e4m3fn with a descale per batch and head.

``attention()`` takes float8_e4m3fn query, key and value (or a 16-bit query with FP8 keys and
values) with FlashAttention-3's descales: float32 (B, H_kv), the real value being the stored
one times its descale. :func:`quantize_fp8` makes such a pair from a 16- or 32-bit tensor.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor, heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, descale)``: ``x`` (B, H, L, D) as float8_e4m3fn with one float32 descale per batch
    and group of heads, so that ``x_fp8.float() * descale`` (repeated over each group's heads)
    approximates ``x``.

    Args:
        x: (B, H, L, D), float16, bfloat16 or float32.
        heads: how many descales per batch: H (None), or H_kv for a query whose H heads read H_kv
            key/value heads (its descale is indexed by the key/value head, FlashAttention-3's
            convention): each group of H // H_kv consecutive heads shares one.

    Returns:
        x_fp8 (B, H, L, D) float8_e4m3fn, each value rounded to nearest after division by its
        descale; descale (B, heads) float32, each group's largest magnitude over 448 (1 for an
        all-zero group), so no value saturates.
    """
    if not isinstance(x, torch.Tensor) or x.ndim != 4:
        raise ValueError(f"x must be a 4-D tensor (B, H, L, D), got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    B, H, L, D = x.shape
    heads = H if heads is None else heads
    if type(heads) is not int or heads < 1 or H % heads:
        raise ValueError(f"heads must be a positive int dividing H = {H}, got {heads!r}")
    groups = x.float().reshape(B, heads, (H // heads) * L * D)
    amax = groups.abs().amax(dim=-1) if groups.shape[-1] else groups.new_zeros(B, heads)  # (empty: descale 1)
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    x_fp8 = (groups / descale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x_fp8.reshape(B, H, L, D), descale


def dequantize_fp8(x_fp8: torch.Tensor, descale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The real values of ``x_fp8`` (B, H, L, D) with descales (B, heads): float32 (or ``dtype``)."""
    B, H = x_fp8.shape[:2]
    group = H // descale.shape[1]
    return (x_fp8.to(torch.float32) * descale.repeat_interleave(group, dim=1)[:, :, None, None]).to(dtype)
