"""``pad_input`` and ``unpad_input`` with FlashAttention's signatures and return values, written in
torch (its tests build their packed inputs and references with them; they are not kernels)."""

import torch
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(batch, seqlen, ...) and a (batch, seqlen) mask -> (the kept rows (nnz, ...), their flat
    indices, cu_seqlens int32, max_seqlen, each sequence's used length int32); ``unused_mask``:
    rows kept but not counted as used."""
    kept = attention_mask if unused_mask is None else (attention_mask + unused_mask).bool()
    lengths = kept.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return rows[indices], indices, cu_seqlens, int(lengths.max().item()), used


def pad_input(hidden_states, indices, batch, seqlen):
    """The rows (nnz, ...) back to (batch, seqlen, ...), zeros elsewhere (differentiable)."""
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    return out.index_put((indices,), hidden_states).reshape(batch, seqlen, *hidden_states.shape[1:])
