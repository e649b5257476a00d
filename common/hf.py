"""Our kernels as attention implementations of Hugging Face transformers.

    import common.hf
    common.hf.register()  # adds "triton" and "ninetoothed"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="triton")

Each name gets an attention function (``AttentionInterface``) and the mask
builder that SDPA uses (``AttentionMaskInterface``): models hand us the same
boolean (batch, 1, Lq, Lk) masks, or none plus ``is_causal``, that they hand
SDPA. Grouped-query heads reach the kernel as they are (``enable_gqa``), never
repeated. transformers is an optional dependency (``pip install -e ".[hf]"``).

Models train through them too (the backends are differentiable), attention
dropout included. Sliding windows (Mistral, Gemma 2), attention-logit
soft-capping (Gemma 2) and attention sinks (gpt-oss) pass through. What the
kernels lack, the call rejects with a clear error instead of computing
something else: position biases.
"""

from __future__ import annotations

import functools

from common.dispatch import attention

NAMES = ("triton", "ninetoothed")


def _attention_forward(backend, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       is_causal=None, **kwargs):
    """One attention layer: query (B, H, Lq, D), key/value (B, H_kv, Lk, D) -> ((B, Lq, H, Dv), None)."""
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"the {backend!r} attention implementation does not support position_bias")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # gpt-oss: one learned logit per query head
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' SDPA integration: a mask, when given, already holds the
    # causal pattern (and a sliding window's); one query token (decoding) sees
    # every cached key.
    is_causal = bool(is_causal) and attention_mask is None and q_len > 1
    if is_causal and kv_len > q_len:
        # Prefill into an empty static cache: keys past Lq are empty slots, and
        # top-left causal alignment would never reach them anyway.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    window = None
    sliding_window = kwargs.get("sliding_window")
    if sliding_window is not None and is_causal:
        # No mask: the window is ours to apply (transformers keeps the keys with
        # q - k < sliding_window). With a mask it is in the mask already.
        window = (int(sliding_window) - 1, 0)
    out = attention(
        query, key, value, is_causal=is_causal, scale=scaling, attn_mask=attention_mask,
        dropout_p=float(dropout), enable_gqa=query.shape[1] != key.shape[1], backend=backend, window=window,
        softcap=kwargs.get("softcap"), sinks=sinks,
    )
    return out.transpose(1, 2).contiguous(), None


def register(names=NAMES) -> tuple[str, ...]:
    """Register our backends with transformers under ``names``; returns them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name in names:
        AttentionInterface.register(name, functools.partial(_attention_forward, name))
        AttentionMaskInterface.register(name, sdpa_mask)
    return tuple(names)
