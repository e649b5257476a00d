"""A paged KV cache: ``paged_attention`` and ``append_kv`` (vLLM's and FlashInfer's layout).

The cache holds keys and values in fixed-size pages, (num_pages, page_size, H_kv, D), of any
size from one token (SGLang's) up on the Triton backend; a block table (B, max_pages) lists each sequence's pages
in order and ``cache_seqlens`` (B,) how many keys each holds. ``append_kv`` writes new tokens
into their slots, and ``paged_attention`` attends a batch of queries over their sequences'
pages: a step of BLOCK_N keys, whatever the page size (the Triton kernel gathers them key by
key into one tile; NineToothed's picks tiles of a page by scalar index, unrolled per step,
which takes pages of multiples of 16 keys), the pages of a long sequence split
across programs (merged by the same kernel that merges the dense decode path's splits),
grouped-query heads packed into rows (sinks and ALiBi slopes then read per row). The dense
path's features, in both kernels: a window around each row's position (the key blocks
outside a row block's windows never visited), soft-capped scores, attention sinks (the
first split's), ALiBi (FlashAttention's bias, from each row's position in its sequence)
and the log-sum-exp (the merged one, with split pages). FP8 caches (float8_e4m3fn with a
descale per sequence and K/V head) under a 16-bit query: pages widened to float16 as they are
read; ``append_kv`` quantizes 16-bit new tokens into them as it writes.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from common import plan as planning
from common.backends import ANY_PAGE, OFFSETS64, resolve
from common.configs import Config, default_config, next_power_of_2, padded_head_dim
from common.ops import _on_device, _quiet
from common.outputs import allocator, partials
from common.reuse import PlanCache
from common.validation import (
    _FLOAT8,
    FP8_DTYPES,
    OFFSET_LIMIT,
    SUPPORTED_DTYPES,
    _check_alibi,
    _check_descale,
    _check_flag,
    _check_kernel_device,
    _check_real,
    _check_sinks,
    _check_softcap,
    _check_window,
    _dtype_name,
    slice_span,
    within_offsets,
)


@dataclasses.dataclass(slots=True)
class PagedPlan:
    """Everything a paged-attention launch needs."""

    query: torch.Tensor  # (B, Hp, Lqp, D): grouped-query heads packed into rows where the strides allow
    key_cache: torch.Tensor  # (num_pages, PAGE, H_kv, D)
    value_cache: torch.Tensor  # (num_pages, PAGE, H_kv, Dv)
    block_table: torch.Tensor  # (B, max_pages) int32
    cache_seqlens: torch.Tensor  # (B,) int32
    scale: float
    is_causal: bool
    group: int  # query heads per K/V head in the kernel's view (1 once packed)
    lq_seq: int  # query rows per head, Lq: packed row r is row r % Lq of its head
    shape: tuple[int, int, int, int]  # (B, H, Lq, Dv)
    band: tuple[int, int] | None = None  # the row at position p sees keys p + band[0] .. p + band[1]; None: all
    softcap: float = 0.0  # > 0: scores s become softcap * tanh(s / softcap)
    softcap_kind: planning.Softcap = planning.Softcap.OFF
    # per row as the query's rows (packed heads' rows too): float32 (B, H, Lq), or where packed (B, H_kv, group * Lq)
    sinks: torch.Tensor | None = None  # the (H,) sink logits
    alibi: torch.Tensor | None = None  # ALiBi's (H,) or (B, H) slopes
    leftpad: torch.Tensor | None = None  # (B,) int32: sequence b's keys start at leftpad[b] (None: at 0)
    query_lengths: torch.Tensor | None = None  # (B,) int32: sequence b's first query_lengths[b] rows (None: Lq)
    with_lse: bool = False  # the caller gets the log-sum-exp
    # FP8 caches (float8_e4m3fn under a 16-bit query): the float32 (B, H_kv) key and value
    # descales (ones where not given); the kernels widen pages to float16 (planning.Widen)
    descales: tuple[torch.Tensor, torch.Tensor] | None = None
    config: Config | None = None
    block_d: int = 0
    block_dv: int = 0
    m_blocks: int = 0
    num_splits: int = 1
    blocks_per_split: int = 0  # in split blocks
    split_block: int = 0  # keys a split holds a multiple of: whole pages and whole key steps (their lcm)
    dot_precision: str = "ieee"
    out: torch.Tensor | None = None  # (B, Hp, Lqp, Dv)
    lse: torch.Tensor | None = None  # (B, Hp, Lqp) float32, when with_lse
    o_part: torch.Tensor | None = None  # split: (B, Hp, Lqp, S, Dv) float32
    lse_part: torch.Tensor | None = None  # split: (B, Hp, Lqp, S) float32
    merge: planning.Merge | None = None
    refinement: object = None  # the backend's own decisions (its refine_paged; as ForwardPlan.refinement)
    planner: planning.Planner = None  # the settings it was planned with

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    query_lengths: torch.Tensor | None = None,
    return_lse: bool = False,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = False,
):
    """Attention of each sequence's newest queries over its keys in a paged cache.

    Args:
        query: (B, H, Lq, D): each sequence's newest Lq tokens, whose keys and values
            are already in the cache; float16, bfloat16 or float32.
        key_cache: (num_pages, page_size, H_kv, D); value_cache: (num_pages,
            page_size, H_kv, Dv); query's dtype and device, or both float8_e4m3fn under a
            float16 or bfloat16 query (an FP8 cache: see k_descale). Any page size >= 1 on the
            "triton" and "torch" backends, multiples of 16 on "ninetoothed". Any strides: a
            value cache viewed from pages stored (num_pages, H_kv, Dv, page_size) (each page
            column-major) is what FP8 decoding reads fastest from pages of 64 keys or more.
        block_table: int32 (B, max_pages): sequence b's keys j live in page
            block_table[b, j // page_size], slot j % page_size.
        cache_seqlens: int32 (B,): how many keys sequence b has (<= max_pages * page_size).
        is_causal: bottom-right: query row i of sequence b sits at position
            p = cache_seqlens[b] - Lq + i and sees the keys up to it. Without it (and
            without a window), every row sees all of its sequence's keys.
        scale: None (1/sqrt(D)) or any finite float.
        enable_gqa: allow H_kv < H (H a multiple of H_kv).
        window: None, or (left, right) ints >= -1: the row at position p sees keys
            p - left .. p + right (-1: unbounded on that side); with is_causal too,
            right is 0 at most. The kernels visit only the key blocks a row block's
            window reaches (a sliding-window decode reads its window, not the cache).
        softcap: None, or a positive float: scores s (scaled) become softcap * tanh(s /
            softcap) before masking (Gemma 2). Kernel backends only.
        sinks: None, or (H,) float on query's device: one logit per query head that joins
            each row's softmax denominator with no value (gpt-oss). Kernel backends only.
        alibi_slopes: None, or float32 (H,) or (B, H) on query's device: ALiBi, the bias
            -slope * |p - j| added to the (capped) score of key j for the row at position
            p (FlashAttention's, bottom-right as the rows' positions are).
        cache_leftpad: None, or int32 (B,) on query's device: sequence b's keys are positions
            cache_leftpad[b] .. cache_seqlens[b] - 1 (FlashAttention's left padding: the
            keys before it are not attended; the rows' positions, and so causality, windows
            and ALiBi, stay those of the cache). The key blocks before it are not read.
        query_lengths: None, or int32 (B,) on query's device, each in 0..Lq: sequence b
            has query_lengths[b] new tokens, the first rows of its Lq (the others padding:
            output 0, lse -inf), at positions cache_seqlens[b] - query_lengths[b] + i
            (FlashAttention's varlen queries over a paged cache).
        return_lse: also return the log-sum-exp (natural log) of each row's scaled,
            soft-capped, biased, masked scores (and its sink), float32 (B, H, Lq).
        k_descale, v_descale: with FP8 caches, None (1) or float32 (B, H_kv) on query's device:
            a cached key's (value's) real value is its stored one times the descale of its
            sequence and K/V head (FlashAttention-3's convention). The kernels widen the pages
            to float16 (exact; a bfloat16 query is narrowed to float16 times a power of two,
            as attention() does) and keep the probabilities in float16; the output has query's dtype.
        backend: "triton", "ninetoothed" or "torch" (the reference: the pages gathered
            into a dense batch for SDPA, the lengths and window as a boolean mask; no
            softcap, no sinks).
        validate: also check, with a host sync, that every length fits the table and
            every page a sequence uses lies in the cache. Without it nothing is read
            back to the host; a page entry outside the cache is clamped into it (a
            wrong page is read, never memory outside the cache).

    Returns:
        (B, H, Lq, Dv) in query's dtype; with return_lse, (output, lse). A row that sees
        no key (an empty sequence, or a window that misses every key) is 0, its lse -inf
        (the sink's logit with sinks). Forward only (no gradient: a cache is read at inference).

    Raises:
        TypeError, ValueError: for bad input, before any kernel launches.
    """
    chosen = resolve(backend)
    layout = _layout(chosen, query, key_cache, value_cache, block_table, cache_seqlens, is_causal, scale,
                     enable_gqa, validate, (window, softcap, sinks, alibi_slopes, cache_leftpad, query_lengths,
                                            return_lse, k_descale, v_descale))
    template = _templates.get(layout) if layout is not None else None
    if template is not None:  # validated and planned before: launch
        plan = PagedPlan(*template)
        plan.query = query if plan.query is None else query.view(plan.query)
        plan.key_cache, plan.value_cache, plan.block_table, plan.cache_seqlens = (
            key_cache, value_cache, block_table, cache_seqlens)
        plan.sinks = planning.packed_rows(_sink_rows(sinks, plan.shape), plan.query)
        plan.alibi = planning.packed_rows(_slope_rows(alibi_slopes, plan.shape), plan.query)
        plan.leftpad, plan.query_lengths = cache_leftpad, query_lengths
        if plan.descales is not None:
            plan.descales = _cache_descales(k_descale, v_descale, key_cache, plan.shape[0])
        return _launch(chosen, plan)
    B, H, Lq, D = _check_query(query)
    num_pages, page, H_kv, Dv = _check_caches(key_cache, value_cache, query, chosen, fp8=True)
    descales = _check_cache_descales(k_descale, v_descale, key_cache, B, query)
    _check_table(block_table, cache_seqlens, B, query)
    is_causal = _check_flag("is_causal", is_causal)
    enable_gqa = _check_flag("enable_gqa", enable_gqa)
    validate = _check_flag("validate", validate)
    _check_heads(H, H_kv, enable_gqa)
    scale = 1.0 / math.sqrt(D) if scale is None else _check_real("scale", scale)
    window, softcap, return_lse = _check_features(chosen, window, softcap, sinks, return_lse, H, query.device)
    if alibi_slopes is not None:
        alibi_slopes = _check_alibi(alibi_slopes, B, H, query.device)
    if cache_leftpad is not None:
        _check_lengths("cache_leftpad", cache_leftpad, B, query)
    if query_lengths is not None:
        _check_lengths("query_lengths", query_lengths, B, query)
    if validate:
        _validate_contents(block_table, cache_seqlens, num_pages, page)
    if B * H * Lq == 0:
        out = query.new_zeros((B, H, Lq, Dv))
        return (out, query.new_full((B, H, Lq), float("-inf"), dtype=torch.float32)) if return_lse else out
    if not chosen.kernels:
        return _paged_reference(query, key_cache, value_cache, block_table, cache_seqlens, is_causal, scale,
                                window=window, alibi_slopes=alibi_slopes, leftpad=cache_leftpad,
                                query_lengths=query_lengths, with_lse=return_lse, descales=descales)
    plan = _make_plan(chosen, query, key_cache, value_cache, block_table, cache_seqlens, is_causal, scale,
                      window=window, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, leftpad=cache_leftpad,
                      query_lengths=query_lengths, with_lse=return_lse, descales=descales)
    if layout is not None:
        _templates.put(layout, _template_of(plan, query))
    return _launch(chosen, plan)


def _check_features(chosen, window, softcap, sinks, return_lse, H, device):
    """window, softcap, sinks and return_lse (the dense path's checks and messages): the
    window as ``common.validation._check_window`` gives it, softcap as a float or None,
    return_lse as a bool. The torch backend takes no softcap and no sinks."""
    window = _check_window(window)
    if softcap is not None:
        softcap = _check_softcap(chosen, softcap)
    if sinks is not None:
        _check_sinks(chosen, sinks, H, device)
    return window, softcap, _check_flag("return_lse", return_lse)


def _sink_rows(sinks, shape):
    """The (H,) sink logits as the kernels read them: a float32 (B, H, Lq) view (None: no sinks)."""
    if sinks is None:
        return None
    B, H, Lq, _ = shape
    return sinks.float().view(1, H, 1).expand(B, H, Lq)


def _slope_rows(slopes, shape):
    """ALiBi's (H,) or (B, H) slopes as the kernels read them: a float32 (B, H, Lq) view (None: no ALiBi)."""
    if slopes is None:
        return None
    B, H, Lq, _ = shape
    return slopes.detach().expand(B, H)[:, :, None].expand(B, H, Lq)


def paged_band(is_causal: bool, window, Lq: int) -> tuple[int, int] | None:
    """Which keys each query row sees, as offsets from its position p (row i of a sequence
    of Lk keys at p = Lk - Lq + i): keys p + lo .. p + hi (then clipped to [0, Lk)); None
    when every row sees all of its sequence's keys. ``window`` (left, right): -1 unbounded;
    ``is_causal``: hi is 0 at most."""
    left, right = window if window is not None else (-1, -1)
    hi = planning.UNBOUNDED if right < 0 else right
    if is_causal:
        hi = min(hi, 0)
    lo = -planning.UNBOUNDED if left < 0 else -left
    if lo == -planning.UNBOUNDED and hi >= Lq - 1:
        return None  # (the last row's position is Lk - 1: e.g. causal decoding, Lq = 1)
    return lo, hi


# A serving loop calls paged_attention with the same caches, table and lengths tensors at
# every step: what validation decides and what the plan holds depend only on the arguments
# and on the tensors' shapes, dtypes and devices (and the query's strides, which packing
# reads), never on their data. The first call of a layout keeps its plan's fields (tensors
# out) and later ones only allocate their outputs and launch. (As common.dispatch does for
# attention.)
_templates = PlanCache()


def _layout(chosen, query, key_cache, value_cache, block_table, cache_seqlens, is_causal, scale, enable_gqa,
            validate, features):
    """The key of a call's template, or None where the full path must run (bad or unusual
    arguments: their checks; validate=True: it reads the tensors). ``features``: (window,
    softcap, sinks, alibi_slopes, cache_leftpad, query_lengths, return_lse), each part of the
    key (the tensors by shape, dtype and device)."""
    tensors = (query, key_cache, value_cache, block_table, cache_seqlens)
    if (any(type(t) is not torch.Tensor for t in tensors) or type(is_causal) is not bool
            or type(enable_gqa) is not bool or validate is not False or not (scale is None or type(scale) is float)
            or not chosen.kernels):
        return None
    features = _feature_key(*features)
    if features is None:
        return None
    return (chosen.name, chosen.interpreted(), planning.reuse_key(), paged_config, is_causal, scale, enable_gqa,
            features, query.stride(), planning.width_class(query, key_cache, value_cache),
            *((t.shape, t.dtype, t.device) for t in tensors))


def _feature_key(window, softcap, sinks, alibi_slopes, cache_leftpad, query_lengths, return_lse, k_descale,
                 v_descale):
    """(window, softcap, the sinks', the slopes', the left padding's, the query lengths' and the
    descales' (shape, dtype, device) or None, return_lse) for the template's key, or None where
    one of them is unusual (its checks must run)."""
    if window is not None and not (type(window) is tuple and len(window) == 2
                                   and all(type(n) is int and n >= -1 for n in window)):
        return None
    if softcap is not None and not (type(softcap) is float and 0.0 < softcap < math.inf):
        return None
    tensors = (sinks, alibi_slopes, cache_leftpad, query_lengths, k_descale, v_descale)
    if any(t is not None and type(t) is not torch.Tensor for t in tensors) or type(return_lse) is not bool:
        return None
    if any(t is not None and t.requires_grad for t in (k_descale, v_descale)):
        return None  # (its check says so)
    return window, softcap, *(None if t is None else (t.shape, t.dtype, t.device) for t in tensors), return_lse


def _template_of(plan: PagedPlan, query) -> tuple:
    """The plan's fields with its tensors out (the packed query's shape in its place, or None; FP8
    caches' descales, each call's own, an empty tuple in theirs)."""
    fields = planning.tensorless_fields(plan)
    fields[0] = tuple(plan.query.shape) if plan.query.shape != query.shape else None
    if plan.descales is not None:
        fields[_DESCALES] = ()
    return tuple(fields)


_DESCALES = [f.name for f in dataclasses.fields(PagedPlan)].index("descales")


def _launch(chosen, plan: PagedPlan):
    """Allocate the plan's outputs, launch, return (B, H, Lq, Dv) and, with_lse, its (B, H, Lq) lse."""
    query = plan.query
    with _on_device(query.device):
        alloc = allocator()
        B, Hp, Lqp, _ = query.shape
        Dv = plan.shape[3]
        plan.out = alloc((B, Hp, Lqp, Dv), query.dtype, query.device)
        plan.lse = alloc((B, Hp, Lqp), torch.float32, query.device) if plan.with_lse else None
        if plan.split:
            plan.o_part, plan.lse_part = partials((B, Hp, Lqp), plan.num_splits, Dv, query.device)
        with _quiet(chosen):
            out, lse = chosen.load().paged_forward(plan)
    # (packed rows, contiguous, are the heads' rows in order)
    return (out.view(plan.shape), lse.view(plan.shape[:3])) if plan.with_lse else out.view(plan.shape)


def append_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Write new tokens into their slots of a paged cache, keys and values in one launch.

    Token i of sequence b (key[b, :, i], value[b, :, i]) goes to position
    cache_seqlens[b] + i: slot (cache_seqlens[b] + i) % page_size of page
    block_table[b, (cache_seqlens[b] + i) // page_size]. The caches change in place;
    cache_seqlens does not.

    Args:
        key_cache, value_cache, block_table, cache_seqlens: as for :func:`paged_attention`.
        key: (B, H_kv, L_new, D); value: (B, H_kv, L_new, Dv); the caches' dtype and device,
            or float16/bfloat16 into float8_e4m3fn caches: each element is divided by its
            sequence and head's descale and rounded to e4m3 (to nearest even, saturated at
            +-448, as ``quantize_fp8``) in the same launch as the write.
        k_descale, v_descale: with FP8 caches, None (1) or float32 (B, H_kv) on key's device
            (as for :func:`paged_attention`: the cache's real value is the stored one times it).
        backend: "triton" or "ninetoothed" (one kernel), or "torch" (indexed assignment; it
            reads the positions back to the host).
        validate: check with a host sync that every new token has a page in the table
            and in the cache. Without it, a token whose position falls past the table or
            whose page lies outside the cache is not written.

    Returns:
        The new lengths, cache_seqlens + L_new (a new int32 tensor).
    """
    chosen = resolve(backend)
    tensors = (key, value, key_cache, value_cache, block_table, cache_seqlens)
    descales = (k_descale, v_descale)
    layout = None
    if (all(type(t) is torch.Tensor for t in tensors) and validate is False and chosen.kernels
            and all(d is None or (type(d) is torch.Tensor and not d.requires_grad) for d in descales)):
        layout = (chosen.name, chosen.interpreted(),
                  *(None if t is None else (t.shape, t.dtype, t.device) for t in tensors + descales))
        if layout in _appends:  # checked before (nothing it checks depends on the data)
            B, _, L_new, D = key.shape
            if B * key.shape[1] * L_new:
                fp8 = _cache_descales(k_descale, v_descale, key_cache, B) if key_cache.dtype in FP8_DTYPES else None
                _append(chosen, key_cache, value_cache, block_table, cache_seqlens, key, value, fp8)
            return cache_seqlens + L_new
    fp8 = _check_append(chosen, key_cache, value_cache, block_table, cache_seqlens, key, value, validate, descales)
    if layout is not None:
        _appends.put(layout, True)
    B, H_kv, L_new, _ = key.shape
    if B * H_kv * L_new == 0:
        return cache_seqlens + L_new
    if not chosen.kernels:
        _append_reference(key_cache, value_cache, block_table, cache_seqlens, key, value, fp8)
    else:
        _append(chosen, key_cache, value_cache, block_table, cache_seqlens, key, value, fp8)
    return cache_seqlens + L_new


_appends = PlanCache()  # the layouts append_kv has checked -> True (see _templates below)


def _append(chosen, key_cache, value_cache, block_table, cache_seqlens, key, value, descales) -> None:
    L_new, D, Dv = key.shape[2], key.shape[3], value.shape[3]
    with _on_device(key.device), _quiet(chosen):
        chosen.load().append_kv(key_cache, value_cache, block_table, cache_seqlens, key, value,
                                block_m=min(64, max(16, next_power_of_2(L_new))),
                                block_d=padded_head_dim(D), block_dv=padded_head_dim(Dv), descales=descales)


# -- validation ------------------------------------------------------------------------------

def _check_query(query):
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    if query.ndim != 4:
        raise ValueError(f"query must be 4-D (batch, heads, new_tokens, head_dim), got shape {tuple(query.shape)}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query has dtype {_dtype_name(query.dtype)}; supported: "
                        + ", ".join(map(_dtype_name, SUPPORTED_DTYPES)))
    return query.shape


def _check_caches(key_cache, value_cache, like, backend, new_tokens=False, fp8=False):
    """(num_pages, page_size, H_kv, Dv) of two caches that fit ``like`` (the query, or the new keys);
    ``fp8``: both may be float8_e4m3fn under a float16 or bfloat16 ``like``."""
    like_name = "key" if new_tokens else "query"
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cache(name, t, like, like_name, fp8)
    if fp8 and (key_cache.dtype in FP8_DTYPES) != (value_cache.dtype in FP8_DTYPES):
        raise TypeError(f"key_cache and value_cache must both be float8_e4m3fn or neither, got "
                        f"{_dtype_name(key_cache.dtype)} and {_dtype_name(value_cache.dtype)}")
    if like.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {_dtype_name(like.dtype)} is not supported; supported: "
                        + ", ".join(map(_dtype_name, SUPPORTED_DTYPES)))
    num_pages, page, H_kv, D = key_cache.shape
    if value_cache.shape[:3] != key_cache.shape[:3]:
        raise ValueError(f"key_cache and value_cache must share (num_pages, page_size, kv_heads), got "
                         f"{tuple(key_cache.shape[:3])} and {tuple(value_cache.shape[:3])}")
    if not new_tokens and D != like.shape[3]:
        raise ValueError(f"query and key_cache must have the same head dim, got {like.shape[3]} and {D}")
    if backend.kernels:
        _check_kernel_caches(backend, key_cache, value_cache, like)
    return num_pages, page, H_kv, value_cache.shape[3]


def _check_cache(name, cache, like, like_name, fp8=False):
    """One cache: a 4-D tensor of ``like``'s dtype (``fp8``: or float8_e4m3fn under a 16-bit
    ``like``) and device."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.ndim != 4:
        raise ValueError(f"{name} must be 4-D (num_pages, page_size, kv_heads, head_dim), "
                         f"got shape {tuple(cache.shape)}")
    if fp8 and cache.dtype in FP8_DTYPES:
        if like.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name} is float8_e4m3fn: an FP8 cache takes a float16 or bfloat16 {like_name}, got "
                            f"{_dtype_name(like.dtype)}")
    elif cache.dtype in _FLOAT8:
        raise TypeError(f"{name} has dtype {_dtype_name(cache.dtype)}; "
                        + ("the only 8-bit float taken is float8_e4m3fn" if fp8 else
                           "this function takes no FP8 cache so far (paged_attention and append_kv take "
                           "float8_e4m3fn ones)"))
    elif cache.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {_dtype_name(cache.dtype)} but {like_name} has "
                        f"{_dtype_name(like.dtype)}: they must share one dtype")
    if cache.device != like.device:
        raise ValueError(f"{name} is on {cache.device} but {like_name} is on {like.device}")


def _check_cache_descales(k_descale, v_descale, key_cache, B, like):
    """The (key, value) descales of FP8 caches, float32 (B, H_kv) each (ones where None), or None
    for 16-bit caches (where giving one is an error)."""
    H_kv = key_cache.shape[2]
    for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
        if d is None:
            continue
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(d).__name__}")
        if key_cache.dtype not in FP8_DTYPES:
            raise ValueError(f"{name} was given but the caches are {_dtype_name(key_cache.dtype)}: descales go "
                             "with float8_e4m3fn caches")
        _check_descale(name, d, (B, H_kv), "sequence", like.device, "the caches")
    if key_cache.dtype not in FP8_DTYPES:
        return None
    return _cache_descales(k_descale, v_descale, key_cache, B)


def column_pages(value_cache) -> bool:
    """Whether the value pages are stored column-major (a page's keys contiguous for each head and
    column), read at each launch as :func:`cache_widen`: both paged kernels then load value tiles along
    the keys (their ``VALUE_COLUMNS``). A page of one key is either layout; it counts as row-major."""
    return value_cache.stride(1) == 1 and value_cache.shape[1] > 1


def cache_widen(descales, value_cache) -> planning.Widen:
    """What the paged kernels widen their tiles to (one setting for keys and values), read at each
    launch since a kept plan serves value pages of either layout: nothing for 16-bit caches, float16
    for FP8 ones, FLOAT16_ROWS where the value pages are row-major (keys a row apart: widened before
    the P·V product's transpose, ``common.jit_helpers._keep_widened``)."""
    if descales is None:
        return planning.Widen.NONE
    return planning.Widen.FLOAT16_ROWS if value_cache.stride(3) == 1 else planning.Widen.FLOAT16


def _cache_descales(k_descale, v_descale, key_cache, B):
    """Checked descales of FP8 caches, a ones view (B, H_kv) for each not given (the kernels read both)."""
    shape = (B, key_cache.shape[2])
    return tuple(d if d is not None else planning._one(key_cache.device).expand(shape) for d in (k_descale, v_descale))


def _check_kernel_caches(backend, key_cache, value_cache, like):
    """What the kernels take: pages of any size (or of multiples of 16 keys), their head
    dims, 32-bit offsets where the backend has no others, and tensors they can reach."""
    page = key_cache.shape[1]
    if page % 16 and not backend.supports(ANY_PAGE):
        raise ValueError(f"page_size (key_cache.shape[1]) must be a multiple of 16 for the {backend.name!r} "
                         f"backend (its kernel reads whole tiles of 16 keys or more: COMPARISON.md), got {page}; "
                         "the 'triton' backend takes any page size")
    low, high = backend.head_dims
    for name, d in (("query/key", key_cache.shape[3]), ("value", value_cache.shape[3])):
        if not low <= d <= high:
            raise ValueError(f"{name} head dim {d} is outside the {backend.name!r} backend's range "
                             f"{low}..{high}")
    if not backend.supports(OFFSETS64):
        _check_cache_offsets(backend, key_cache=key_cache, value_cache=value_cache, query=like)
    _check_kernel_device(backend, like.device)


def _check_cache_offsets(backend, **tensors):
    for name, t in tensors.items():
        if slice_span(t) >= OFFSET_LIMIT:
            raise ValueError(f"{name}'s part for one page and slot (one batch and head of the query) spans "
                             f"{slice_span(t)} elements; the {backend.name!r} backend indexes within it with "
                             f"32-bit offsets and takes fewer than {OFFSET_LIMIT}")


def _check_append(chosen, key_cache, value_cache, block_table, cache_seqlens, key, value, validate, descales):
    """Every argument of :func:`append_kv`; with validate=True the table's contents too. Returns
    the FP8 caches' (key, value) descales (see :func:`_check_cache_descales`), or None."""
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, kv_heads, new_tokens, head_dim), got shape {tuple(t.shape)}")
    num_pages, page, H_kv, Dv = _check_caches(key_cache, value_cache, key, chosen, new_tokens=True, fp8=True)
    if value.dtype != key.dtype or value.device != key.device:
        raise TypeError(f"value ({_dtype_name(value.dtype)} on {value.device}) must share key's dtype and device "
                        f"({_dtype_name(key.dtype)} on {key.device})")
    B, _, L_new, _ = key.shape
    if key.shape[1] != H_kv or key.shape[3] != key_cache.shape[3]:
        raise ValueError(f"key must be (B, {H_kv}, L_new, {key_cache.shape[3]}) to match key_cache, "
                         f"got {tuple(key.shape)}")
    if tuple(value.shape) != (B, H_kv, L_new, Dv):
        raise ValueError(f"value must be {(B, H_kv, L_new, Dv)} to match key and value_cache, "
                         f"got {tuple(value.shape)}")
    _check_table(block_table, cache_seqlens, B, key)
    fp8 = _check_cache_descales(*descales, key_cache, B, key)
    if _check_flag("validate", validate):
        _validate_contents(block_table, cache_seqlens + L_new, num_pages, page)
    return fp8


def _check_table(block_table, cache_seqlens, B, like):
    for name, t, ndim in (("block_table", block_table, 2), ("cache_seqlens", cache_seqlens, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {_dtype_name(t.dtype)}")
        if t.ndim != ndim or t.shape[0] != B:
            raise ValueError(f"{name} must be {'(B, max_pages)' if ndim == 2 else '(B,)'} with B = {B}, "
                             f"got shape {tuple(t.shape)}")
        if t.device != like.device:
            raise ValueError(f"{name} is on {t.device} but the tensors are on {like.device}")


def _check_lengths(name, lengths, B, like):
    """A per-sequence int32 (B,) tensor on the query's device (its values not read: no host sync)."""
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(lengths).__name__}")
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (B,) or lengths.device != like.device:
        raise ValueError(f"{name} must be int32 (B,) = ({B},) on {like.device}, got {_dtype_name(lengths.dtype)} "
                         f"of shape {tuple(lengths.shape)} on {lengths.device}")


def _check_heads(H, H_kv, enable_gqa):
    if enable_gqa:
        if H_kv == 0 or H % H_kv:
            raise ValueError(f"with enable_gqa=True the query heads ({H}) must be a multiple of the cache's "
                             f"key/value heads ({H_kv})")
    elif H != H_kv:
        raise ValueError(f"query has {H} heads but the caches have {H_kv}; pass enable_gqa=True for "
                         "grouped-query attention")


def _validate_contents(block_table, lengths, num_pages, page):
    """The checks that read device values (validate=True)."""
    max_pages = block_table.shape[1]
    if bool((lengths < 0).any()) or bool((lengths > max_pages * page).any()):
        raise ValueError(f"cache_seqlens must lie in 0..max_pages * page_size = {max_pages * page}, "
                         f"got {lengths.tolist()}")
    used = torch.arange(max_pages, device=block_table.device)[None, :] * page < lengths[:, None]
    entries = block_table[used]
    if bool(((entries < 0) | (entries >= num_pages)).any()):
        raise ValueError(f"block_table points outside the cache: its pages in use must lie in 0..{num_pages - 1}")


# -- planning and the reference ------------------------------------------------------------

# Shared memory for the pipelined K/V tiles of the paged kernels: decode streams the cache,
# and more stages in flight bring them to the contiguous path's bandwidth (benchmarks/NOTES.md,
# "A paged KV cache").
PAGED_STAGE_BYTES = 160 * 1024
PAGED_MAX_STAGES = {"triton": 5, "ninetoothed": 6}


def paged_config(backend: str, block_d: int, block_dv: int, rows: int, dtype: torch.dtype,
                 cache_dtype: torch.dtype | None = None) -> Config:
    """The paged kernel's configuration (``dtype`` the query's, ``cache_dtype`` the caches'):
    the dense decode path's tiles for these rows, and as many pipeline stages as fit
    PAGED_STAGE_BYTES. The key step (BLOCK_N) is the dense path's whatever the page size: a step
    is part of a page, one page, or several pages (gathered key by key in the Triton kernel,
    unrolled tile by tile in NineToothed's)."""
    cache_dtype = cache_dtype or dtype
    config = default_config(max(block_d, block_dv), min(rows, 64), dtype, cache_dtype)
    per_stage = config.block_n * (block_d + block_dv) * cache_dtype.itemsize
    stages = max(2, min(PAGED_MAX_STAGES.get(backend, 3), PAGED_STAGE_BYTES // per_stage))
    return Config(config.block_m, config.block_n, config.num_warps, stages)


def _make_plan(backend, query, key_cache, value_cache, block_table, cache_seqlens, is_causal, scale, *,
               window=None, softcap=None, sinks=None, alibi_slopes=None, leftpad=None, query_lengths=None,
               with_lse=False, descales=None) -> PagedPlan:
    B, H, Lq, D = query.shape
    H_kv, page, Dv = key_cache.shape[2], key_cache.shape[1], value_cache.shape[3]
    plan = PagedPlan(query, key_cache, value_cache, block_table, cache_seqlens, scale, is_causal, H // H_kv, Lq,
                     (B, H, Lq, Dv), paged_band(is_causal, window, Lq), softcap or 0.0, with_lse=with_lse)
    plan.planner = planner = planning.current_planner()
    plan.softcap_kind = planner.softcap_kind(plan.softcap, query.dtype, query.device, backend.interpreted())
    plan.sinks = _sink_rows(sinks, plan.shape)
    plan.alibi = _slope_rows(alibi_slopes, plan.shape)
    plan.leftpad, plan.query_lengths = leftpad, query_lengths
    plan.descales = descales
    # (sinks and slopes are per query head: packed, each row reads its own, planning.packed_rows)
    if H != H_kv:
        try:  # each group's query heads as rows of its K/V head: K/V read once per group
            packed = query.view(B, H_kv, (H // H_kv) * Lq, D)
        except RuntimeError:  # strides no view can merge
            packed = None
        # (not where a packed head's rows would pass the 32-bit offsets within a head)
        if packed is not None and within_offsets(backend, packed):
            plan.query, plan.group = packed, 1
            plan.sinks, plan.alibi = (planning.packed_rows(rows, packed) for rows in (plan.sinks, plan.alibi))
    _, Hp, Lqp, _ = plan.query.shape
    # (one width for both tiles where an input is read element by element: planning.tile_widths)
    plan.block_d, plan.block_dv = planning.tile_widths(padded_head_dim(D), padded_head_dim(Dv), plan.query,
                                                       key_cache, value_cache)
    plan.config = paged_config(backend.name, plan.block_d, plan.block_dv, Lqp, query.dtype, key_cache.dtype)
    plan.m_blocks = -(-Lqp // plan.config.block_m)
    max_pages = block_table.shape[1]
    # A split holds whole pages (NineToothed's kernel takes its part of the table as a tile)
    # and whole key steps.
    plan.split_block = math.lcm(page, plan.config.block_n)
    # (the thin programs' target whatever the row tile: the wide one was measured for the
    # contiguous cache only)
    plan.num_splits, plan.blocks_per_split = planner.splits(plan.m_blocks * B * Hp, max_pages * page,
                                                            plan.split_block, query.device)
    if plan.split and (not planning.partials_fit(backend, (B, Hp, Lqp), plan.num_splits, Dv)
                       or _window_unsplit(plan, planner, B * Hp, query.device)):
        plan.num_splits, plan.blocks_per_split = 1, -(-(max_pages * page) // plan.split_block)
    # Many short-row programs, unsplit (a large batch): the dense decode's shallow pipeline
    # (benchmarks/NOTES.md, "Decode at a large batch").
    plan.config = planner.shallow_stages(plan.config, plan.m_blocks * B * Hp, plan.num_splits, query.device,
                                         max(plan.block_d, plan.block_dv))
    plan.dot_precision = planning.dot_precision(query.dtype)
    if plan.split:  # (the outputs are allocated at launch: _launch)
        plan.merge = planner.merge(B * Hp * Lqp, plan.num_splits, backend.interpreted(), plan.block_dv)
    # (the bytes the table can address: the lengths themselves are on the device)
    capacity = B * max_pages * page * H_kv * (D + Dv) * key_cache.element_size()
    backend.load().refine_paged(plan, capacity)
    return plan


def _window_unsplit(plan: PagedPlan, planner, programs: int, device) -> bool:
    """Whether a window bounded on the left runs unsplit: the splits cover the table's
    positions, but the keys a row block sees lie within Lq - band[0] of its sequence's end;
    where the planner would not split that many keys, one program per row block reads them
    (a sliding-window decode over a long cache: no split programs with nothing to read, no
    merge)."""
    if plan.band is None or plan.band[0] <= -planning.UNBOUNDED:
        return False
    span = plan.lq_seq - plan.band[0]  # (the first row's window start to the last row's position)
    return planner.splits(plan.m_blocks * programs, span, plan.split_block, device)[0] == 1


def _paged_reference(query, key_cache, value_cache, block_table, cache_seqlens, is_causal, scale, *, window=None,
                     alibi_slopes=None, leftpad=None, query_lengths=None, with_lse=False, descales=None):
    """SDPA on the pages gathered into a dense batch, the sequences' lengths, causality and
    window as a boolean mask (ALiBi's bias added as a float one: -inf where not allowed);
    with_lse: also the log-sum-exp, from the scores in float32. FP8 caches (``descales``): the
    pages dequantized to float32, SDPA in float32, the output in query's dtype."""
    B, H, Lq, _ = query.shape
    num_pages, page, H_kv, _ = key_cache.shape
    pages = block_table.long().clamp(0, num_pages - 1)
    k, v = (cache[pages].flatten(1, 2).transpose(1, 2) for cache in (key_cache, value_cache))  # (B, H_kv, Lk, D)
    out_dtype = query.dtype
    if descales is not None:
        k, v = (t.float() * d[:, :, None, None] for t, d in zip((k, v), descales))
        query = query.float()
    positions = torch.arange(k.shape[2], device=query.device)
    lengths = cache_seqlens.long()
    allowed = positions[None, :] < lengths[:, None]
    if leftpad is not None:
        allowed &= positions[None, :] >= leftpad.long()[:, None]
    allowed = allowed[:, None, None, :]  # (B, 1, 1, Lk)
    band = paged_band(is_causal, window, Lq)
    rows = torch.arange(Lq, device=query.device)[None, :]
    new_tokens = Lq if query_lengths is None else query_lengths.long()[:, None]
    row_positions = lengths[:, None] - new_tokens + rows  # (B, Lq)
    offset = positions[None, None, :] - row_positions[:, :, None]  # (B, Lq, Lk)
    if band is not None:
        allowed = allowed & ((offset >= band[0]) & (offset <= band[1]))[:, None]
    if query_lengths is not None:  # (padding rows: none)
        allowed = allowed & (rows < new_tokens)[:, None, :, None]
    bias = 0.0
    mask = allowed
    if alibi_slopes is not None:  # (B, H, Lq, Lk), -inf where not allowed
        bias = -alibi_slopes[:, :, None, None] * offset.abs()[:, None].float()
        mask = bias.masked_fill(~allowed, float("-inf")).to(query.dtype)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=H != H_kv)
    out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0).to(out_dtype)  # rows with no key: 0, not NaN
    if not with_lse:
        return out
    scores = query.float() @ k.float().repeat_interleave(H // H_kv, 1).transpose(-1, -2) * scale + bias
    return out, scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)  # (-inf: no key)


def _append_reference(key_cache, value_cache, block_table, cache_seqlens, key, value, descales=None):
    B, _, L_new, _ = key.shape
    if descales is not None:  # (quantize_fp8's rule: divided, saturated at +-448, rounded to nearest even)
        key, value = ((t.float() / d[:, :, None, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                      for t, d in zip((key, value), descales))
    num_pages, page = key_cache.shape[:2]
    positions = cache_seqlens.long()[:, None] + torch.arange(L_new, device=key.device)[None, :]  # (B, L_new)
    fits = (positions >= 0) & (positions < block_table.shape[1] * page)
    pages = block_table.long().gather(1, (positions // page).clamp(0, block_table.shape[1] - 1))
    fits &= (pages >= 0) & (pages < num_pages)
    key_cache[pages[fits], (positions % page)[fits]] = key.transpose(1, 2)[fits]
    value_cache[pages[fits], (positions % page)[fits]] = value.transpose(1, 2)[fits]
