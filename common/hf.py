"""Our kernels as attention implementations of Hugging Face transformers.

    import common.hf
    common.hf.register()  # adds "triton", "ninetoothed", "flash_triton" and "flash_ninetoothed"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="triton")

Each name gets an attention function (``AttentionInterface``) and a mask builder
(``AttentionMaskInterface``). "triton" and "ninetoothed" take what SDPA takes: the
same boolean (batch, 1, Lq, Lk) masks, or none plus ``is_causal``. "flash_triton"
and "flash_ninetoothed" take what transformers hands FlashAttention: a (batch, Lk)
padding mask or none, packed sequences by cumulative lengths (padding-free training,
and continuous batching: transformers serves any implementation whose name holds
"flash" through ``generate_batch``, each step's sequences packed, their keys read
from its paged cache) or by position ids; causal and windows bottom-right.
Grouped-query heads reach the kernel as they are (``enable_gqa``), never
repeated. transformers is an optional dependency (``pip install -e ".[hf]"``).

Models train through them too (the backends are differentiable), attention
dropout included. Sliding windows (Mistral, Gemma 2), attention-logit
soft-capping (Gemma 2) and attention sinks (gpt-oss) pass through. What the
kernels lack, the call rejects with a clear error instead of computing
something else: position biases.
"""

from __future__ import annotations

import functools
import os

import torch

from common.dispatch import attention
from common.paged import paged_attention
from common.varlen import varlen_attention

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


def _flash_forward(backend, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                   sliding_window=None, softcap=None, is_causal=None, s_aux=None, position_ids=None,
                   cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, block_table=None,
                   **kwargs):
    """One attention layer as transformers' flash_attention_forward computes it: query (B, H, Lq, D),
    key/value (B, H_kv, Lk, D) -> ((B, Lq, H, Dv), None). The first of these that applies:

    - ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 (N + 1,)) with ``max_length_q``/``max_length_k``:
      B = 1 holds N packed sequences (continuous batching: each sequence's new queries and its
      keys, cached ones first);
    - ``attention_mask`` (B, Lk), 1 for a token, 0 for padding (a 4-D mask is refused): each row
      attends to its sequence's tokens only, the query rows being the last Lq of the mask; padded
      query rows give 0;
    - ``position_ids`` (1, L) that start over: sequences packed without lengths;
    - otherwise every row of the batch over all its keys.

    Causal attention and ``sliding_window`` (keys within sliding_window - 1 of a row's position,
    both sides where not causal) align bottom-right within each sequence, as FlashAttention's;
    ``s_aux`` (or ``sinks``): attention sinks; ``softcap``; ``dropout``; ``deterministic`` (None:
    transformers' FLASH_ATTENTION_DETERMINISTIC=1), as FlashAttention's: a bitwise-reproducible backward
    (``common.attention``'s; the packed and padded paths' backward always is).

    transformers calls FlashAttention's own ``flash_attn_with_kvcache`` (its decode step over a
    block table) only for names carrying FlashAttention's version (flash_attention_2, _3) and
    builds no block table for ours; one reaching here is refused."""
    if block_table is not None:
        raise ValueError(f"the {'flash_' + backend!r} attention implementation takes no block_table: "
                         "transformers gathers the cached keys for it (its varlen path)")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"the {'flash_' + backend!r} attention implementation takes a (batch, key "
                         f"length) padding mask, got one of shape {tuple(attention_mask.shape)} (the 4-D masks "
                         f"are for {backend!r})")
    is_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    B, H, Lq, _ = query.shape
    Lk = key.shape[2]
    window = None
    if sliding_window is not None and Lk > sliding_window:  # (as transformers: a window wider than the keys is none)
        window = (int(sliding_window) - 1, int(sliding_window) - 1)
    features = dict(is_causal=is_causal, scale=scaling, enable_gqa=H != key.shape[1], backend=backend,
                    alignment="bottom_right", window=window, softcap=softcap, dropout_p=float(dropout),
                    sinks=s_aux if s_aux is not None else kwargs.get("sinks"))
    if cu_seq_lens_q is None and attention_mask is None and position_ids is not None and B == 1 and 1 < Lq == Lk:
        cu_seq_lens_q = cu_seq_lens_k = _packed_by_positions(position_ids)  # (None: one sequence)
        max_length_q = max_length_k = Lq
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        if B != 1:
            raise ValueError(f"packed sequences (cu_seq_lens_q) come as a batch of one, got a batch of {B}")
        out = varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                               cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32), int(max_length_q),
                               int(max_length_k), **features)
        return out.unsqueeze(0), None
    if attention_mask is not None:
        return _unpadded(query, key, value, attention_mask.bool(), features), None
    deterministic = kwargs.get("deterministic")
    if deterministic is None:  # (as transformers' flash_attention_forward reads it)
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    out = attention(query, key, value, deterministic=deterministic, **features)
    return out.transpose(1, 2).contiguous(), None


def _paged_flash_forward(backend, module, query, key, value, attention_mask, cache=None, cu_seq_lens_q=None,
                         cu_seq_lens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_table=None, **kwargs):
    """One attention layer of a continuous-batching step under the convention of older
    transformers (5.17 among them: the implementation ``paged|flash_<backend>``, which its ``generate_batch`` takes
    for ``flash_<backend>``): query (1, H, N, D) holds N packed rows of the step's sequences
    (``cu_seq_lens_q``), key/value their new tokens, which are written into its paged ``cache``;
    each sequence's keys are its cached ones then its new ones (``cu_seq_lens_k``; per layer type
    where a dict), causal bottom-right, within ``module.sliding_window`` where set; ``s_aux``:
    attention sinks. Returns ((N, H, Dv), None), as FlashAttention's paged wrapper there.

    A full-attention layer reads the keys where they lie, through our paged kernel (the cache's
    blocks are its pages); a sliding-window layer (whose cache is a rolling buffer), or a step
    with no cached key, has transformers gather them (``cache.update``) for the varlen kernel."""
    name = f"paged|flash_{backend}"
    if cache is None:
        raise ValueError(f"{name!r} was called without a paged attention cache: it serves continuous batching "
                         f"(generate_batch); use 'flash_{backend}' or {backend!r} for a standard forward")
    if block_table is not None:
        raise ValueError(f"{name!r} takes no block_table: transformers gathers the cached keys for it")
    window = getattr(module, "sliding_window", None) or None
    layer_type = "full_attention" if window is None else "sliding_attention"
    if isinstance(cu_seq_lens_k, dict):
        cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k[layer_type], max_seqlen_k[layer_type]
    read_index, write_index = kwargs["read_index"], kwargs["write_index"]
    sinks = kwargs.get("s_aux")
    if window is None:
        pages = _cache_pages(backend, module, cache, read_index, key)
        if pages is not None:
            cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                         read_index=[index[:0] for index in read_index], write_index=write_index)  # (writes only)
            return _over_pages(backend, module, query, *pages, cu_seq_lens_q, cu_seq_lens_k, int(max_seqlen_q),
                               int(max_seqlen_k), sinks), None
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                              read_index=read_index, write_index=write_index)
    out = varlen_attention(query[0].transpose(0, 1), key, value, cu_seq_lens_q.to(torch.int32),
                           cu_seq_lens_k.to(torch.int32), int(max_seqlen_q), int(max_seqlen_k), True,
                           module.scaling, enable_gqa=query.shape[1] != key.shape[1], backend=backend,
                           alignment="bottom_right", window=None if window is None else (int(window) - 1, 0),
                           sinks=sinks)
    return out, None


def _cache_pages(backend, module, cache, read_index, key):
    """(key pages, value pages, the layer's read index, page size) of a full-attention layer's
    cache, its blocks as pages (num_blocks, block_size, H_kv, D): for a step that reads cached keys,
    from a cache laid out as transformers' PagedAttentionCache (5.17) is, in pages the backend
    takes; else None."""
    groups = getattr(cache, "layer_index_to_group_indices", None)
    page = getattr(cache, "block_size", None)
    if groups is None or not isinstance(page, int) or module.layer_idx not in groups:
        return None
    if backend == "ninetoothed" and page % 16:  # (its paged kernel takes pages of multiples of 16 keys)
        return None
    group, in_group = groups[module.layer_idx]
    reads = read_index[group]
    if reads.numel() == 0:  # (no cached key: the new ones are every key)
        return None
    key_cache, value_cache = cache.key_cache[in_group], cache.value_cache[in_group]
    H_kv, D, Dv = key.shape[1], key_cache.shape[-1], value_cache.shape[-1]
    return key_cache.view(-1, page, H_kv, D), value_cache.view(-1, page, H_kv, Dv), reads, page


def _over_pages(backend, module, query, key_pages, value_pages, reads, page, cu_q, cu_k, max_q: int, max_k: int,
                sinks):
    """The packed rows of query (1, H, N, D) over their sequences' keys in the cache's pages ->
    (N, H, Dv). Sequence b's key j lies at slot reads[cu_k[b] + j] of the cache (transformers
    reads whole blocks in order), so its block table row is those slots of its pages' first keys,
    divided by the page size; its queries, padded to max_q rows, are its last keys'. All on the
    device (no host sync: the step may be a CUDA graph's capture, max_q and max_k its bounds)."""
    _, H, N, _ = query.shape
    device = query.device
    cu_q, cu_k = cu_q.long(), cu_k.long()
    query_lengths = (cu_q[1:] - cu_q[:-1]).to(torch.int32)
    seqlens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    firsts = cu_k[:-1, None] + torch.arange(0, max(max_k, 1), page, device=device)
    block_table = (reads[firsts.clamp(max=reads.numel() - 1)] // page).to(torch.int32)
    rows = (cu_q[:-1, None] + torch.arange(max_q, device=device)).clamp(max=N - 1)  # (B, max_q): padding repeats
    padded = query[0][:, rows].transpose(0, 1)  # (B, H, max_q, D)
    out = paged_attention(padded, key_pages, value_pages, block_table, seqlens, True, module.scaling,
                          enable_gqa=H != key_pages.shape[2], sinks=sinks, query_lengths=query_lengths,
                          backend=backend)
    # packed row n: sequence s (the last whose first row is at or before n), its row n - cu_q[s]
    tokens = torch.arange(N, device=device)
    seq = (torch.searchsorted(cu_q, tokens, right=True) - 1).clamp(0, cu_q.numel() - 2)
    slot = seq * max_q + (tokens - cu_q[seq]).clamp(0, max_q - 1)
    return out.transpose(1, 2).flatten(0, 1)[slot]


def _packed_by_positions(position_ids):
    """(N + 1,) int32 cumulative lengths of the sequences packed in ``position_ids`` (1, L): one
    starts at the first token and at each position 0 (one host sync, as transformers' own); None
    for one sequence."""
    positions = position_ids[0]
    first = torch.arange(positions.numel(), device=positions.device) == 0
    starts = ((positions == 0) | first).nonzero().flatten()
    if starts.numel() == 1:
        return None
    ends = torch.tensor([positions.numel()], device=positions.device)
    return torch.cat([starts, ends]).to(torch.int32)


def _unpadded(query, key, value, mask, features):
    """Attention of a padded batch as packed sequences: sequence b's keys are its tokens
    (mask[b]), its queries the tokens among the mask's last Lq; (B, Lq, H, Dv), padded rows 0."""
    B, H, Lq, _ = query.shape
    Lk = mask.shape[1]
    key, value = key[:, :, :Lk], value[:, :, :Lk]  # (a static cache longer than the mask: its tail is unused)
    q_mask = mask[:, -Lq:]
    cu_k, cu_q = (torch.nn.functional.pad(m.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
                  for m in (mask, q_mask))
    rows_k, rows_q = mask.flatten().nonzero().flatten(), q_mask.flatten().nonzero().flatten()
    packed_k, packed_v = (x.transpose(1, 2).flatten(0, 1)[rows_k] for x in (key, value))
    packed_q = query.transpose(1, 2).flatten(0, 1)[rows_q]
    out = varlen_attention(packed_q, packed_k, packed_v, cu_q, cu_k, Lq, Lk, **features)
    full = out.new_zeros(B * Lq, H, out.shape[2])
    full[rows_q] = out
    return full.view(B, Lq, H, out.shape[2])


def register(names=NAMES) -> tuple[str, ...]:
    """Register our backends with transformers under ``names`` (SDPA's calling convention) and,
    for each, ``flash_<name>`` (FlashAttention's: the one continuous batching serves) and
    ``paged|flash_<name>`` (continuous batching's own in older transformers, 5.17 among them); returns every
    name registered."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, sdpa_mask

    registered = []
    for name in names:
        AttentionInterface.register(name, functools.partial(_attention_forward, name))
        AttentionMaskInterface.register(name, sdpa_mask)
        AttentionInterface.register(f"flash_{name}", functools.partial(_flash_forward, name))
        AttentionMaskInterface.register(f"flash_{name}", flash_attention_mask)
        # (older transformers, 5.17 among them, serve continuous batching through "paged|<name>")
        AttentionInterface.register(f"paged|flash_{name}", functools.partial(_paged_flash_forward, name))
        AttentionMaskInterface.register(f"paged|flash_{name}", flash_attention_mask)
        registered += [name, f"flash_{name}", f"paged|flash_{name}"]
    _teach_flash_loader({f"{prefix}flash_{name}": name for name in names for prefix in ("", "paged|")})
    return tuple(registered)


def _teach_flash_loader(flash_names: dict) -> None:
    """transformers (5.x) loads the functions of an implementation whose name holds "flash" when a
    model takes it, from the flash-attn package or the kernels hub only, and refuses the name
    otherwise: its loader (the private ``modeling_flash_attention_utils._lazy_imports``) is
    wrapped to hand it our FlashAttention functions (``common.flash_attn_interface``, bound to
    the backend) for ``flash_names`` and every other name to itself. Our attention function
    (``_flash_forward``) is what runs; the loaded functions only answer transformers' checks
    (no ``flash_attn_with_kvcache``: its decode step over a block table stays off, its varlen
    path on). A transformers without that loader keeps its own checks (an error names them)."""
    from transformers import modeling_flash_attention_utils as flash_utils

    loader = getattr(flash_utils, "_lazy_imports", None)
    if loader is None:
        return
    original = getattr(loader, "_original", loader)

    def lazy_imports(implementation, *args, **kwargs):
        backend = lazy_imports._names.get(implementation)
        if backend is None:
            return original(implementation, *args, **kwargs)
        from common import flash_attn_interface as fa

        return (functools.partial(fa.flash_attn_func, backend=backend),
                functools.partial(fa.flash_attn_varlen_func, backend=backend), None, flash_utils._pad_input,
                flash_utils._unpad_input)

    lazy_imports._original = original
    lazy_imports._names = {**getattr(loader, "_names", {}), **flash_names}
    flash_utils._lazy_imports = lazy_imports
