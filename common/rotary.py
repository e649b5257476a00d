"""The rotary embedding of new queries and keys at their positions, as FlashAttention's
``flash_attn_with_kvcache`` applies it (``rotary_cos``, ``rotary_sin``).

A head dim's first R entries form R / 2 pairs, rotated by the angles of the token's
position: (x1, x2) becomes (x1 cos - x2 sin, x1 sin + x2 cos), ``cos``/``sin`` (S, R / 2)
indexed by the position; the other D - R entries are copied. Interleaved pairs are dims
(0, 1), (2, 3), ...; otherwise (GPT-NeoX) dims i and R / 2 + i. The kernels see the pairs
as two strided views of the input and two of the output, so one kernel serves both.
"""

from __future__ import annotations

import torch

from common.ops import _on_device, _quiet


def apply_rotary(chosen, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, starts: torch.Tensor, *,
                 per_row: bool, interleaved: bool) -> torch.Tensor:
    """``x`` (B, L, H, D) rotated at positions ``starts[b] + l`` (``per_row``) or ``starts[b]``
    (every row), a new tensor of x's layout (B, L, H, D) contiguous. Arguments checked by the
    caller: cos and sin (S, R / 2) of x's dtype and device, R <= D, starts int32 (B,) (a
    position outside 0 .. S - 1 is clamped into it)."""
    R = 2 * cos.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if R < x.shape[3]:
        out[..., R:] = x[..., R:]
    if x.numel() == 0:
        return out
    pairs = [_pair_views(t, R, interleaved) for t in (x, out)]
    if not chosen.kernels:
        _rotary_reference(*pairs[0], *pairs[1], cos, sin, starts, per_row)
        return out
    with _on_device(x.device), _quiet(chosen):
        chosen.load().rotary(*pairs[0], *pairs[1], cos, sin, starts, per_row)
    return out


def _pair_views(t: torch.Tensor, R: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second members of each pair, (B, L, H, R / 2) views of ``t``."""
    if interleaved:
        return t[..., 0:R:2], t[..., 1:R:2]
    return t[..., :R // 2], t[..., R // 2:R]


def _rotary_reference(x1, x2, o1, o2, cos, sin, starts, per_row: bool) -> None:
    """The torch backend's rotation (and the definition the kernels are tested against)."""
    B, L = x1.shape[:2]
    positions = starts.long()[:, None] + (torch.arange(L, device=x1.device)[None, :] if per_row else 0)
    positions = positions.expand(B, L).clamp(0, cos.shape[0] - 1)
    c, s = (table.float()[positions][:, :, None, :] for table in (cos, sin))  # (B, L, 1, R / 2)
    a, b = x1.float(), x2.float()
    o1.copy_(a * c - b * s)
    o2.copy_(a * s + b * c)
