"""``apply_rotary_emb`` with FlashAttention's signature, in torch (its tests' rotary reference)."""

import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """x (batch, seqlen, heads, D) rotated over its first 2 * cos.shape[-1] dims at positions
    ``seqlen_offsets`` (an int, or (batch,)) + 0 .. seqlen - 1: pairs (0, 1), (2, 3), ... when
    ``interleaved``, else (i, rotary_dim / 2 + i); computed in float32, returned in x's dtype."""
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_emb here takes (batch, seqlen, ...) inputs only")
    batch, seqlen = x.shape[:2]
    half = cos.shape[-1]
    positions = torch.arange(seqlen, device=x.device)
    if isinstance(seqlen_offsets, torch.Tensor):
        positions = positions[None, :] + seqlen_offsets.long()[:, None]
    else:
        positions = (positions + seqlen_offsets)[None, :].expand(batch, seqlen)
    c, s = (t[positions].unsqueeze(2).float() for t in (cos, sin))  # (batch, seqlen, 1, half)
    rotated = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    out = torch.cat([rotated.to(x.dtype), x[..., 2 * half:]], dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out
