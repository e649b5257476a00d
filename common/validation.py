"""Every input check of :func:`common.attention`, each with a clear message.

:func:`check_call` and :func:`check_backward` compose small checks, one for each
argument or concern. All run before anything is allocated or launched, so an error
never leaves a half-written output behind. Type problems raise ``TypeError``, value
and shape problems ``ValueError``; each message names the argument and says what was
expected.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys

import torch

from common.backends import BACKENDS, BACKWARD, LSE, OFFSETS64, SINKS, SOFTCAP, Backend

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# 8-bit floats :func:`common.attention` takes (forward only): query, key and value in e4m3, or a
# 16-bit query with e4m3 keys and values; the real value is the stored one times its descale.
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_QUERY_OUT_DTYPES = (torch.bfloat16, torch.float16)  # an FP8 query's output: bfloat16 unless asked
_FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                  "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))
# A backend without 64-bit offsets throughout (NineToothed's generated code indexes
# within one batch and head with 32-bit integers) must see each tensor's part for one
# batch and head span fewer elements than this (:func:`slice_span`).
OFFSET_LIMIT = 2**31


@dataclasses.dataclass
class Call:
    """A validated call, in the 4-D form every backend receives."""

    query: torch.Tensor  # (B, H, Lq, D)
    key: torch.Tensor  # (B, H_kv, Lk, D)
    value: torch.Tensor  # (B, H_kv, Lk, Dv)
    attn_mask: torch.Tensor | None  # None, or a (B, H, Lq, Lk) view (stride 0 where broadcast)
    is_causal: bool
    scale: float
    return_lse: bool
    unbatched: bool  # the inputs were 3-D (H, L, D): drop the batch dim of the results
    dropout_p: float = 0.0
    dropout_seed: torch.Tensor | None = None  # int64, one element, on the inputs' device
    window: tuple[int, int] | None = None  # (left, right) keys around a row's position; -1: unbounded
    bottom_right: bool = False  # query row i sits at position i + Lk - Lq (else i)
    softcap: float | None = None  # scores s become softcap * tanh(s / softcap), before any mask
    sinks: torch.Tensor | None = None  # (H,): a logit per query head in every row's softmax denominator
    row_bands: torch.Tensor | None = None  # packed sequences: per-row bands (common.varlen), B = 1
    alibi_slopes: torch.Tensor | None = None  # (B, H) float32 (a view; stride 0 over B for (H,) slopes), detached
    # packed sequences (common.varlen): alibi_slopes per row, (B, H, Lq), and each row's position
    # shift (Lq,) int32 (row i at position i + shift[i]); None: from bottom_right, the same for every row
    alibi_shifts: torch.Tensor | None = None
    # FP8 inputs: (q_descale, k_descale, v_descale), each a float32 (B, H_kv) tensor or None for 1;
    # None: no FP8 input. out_dtype: the output's dtype (None: the query's).
    descales: tuple | None = None
    out_dtype: torch.dtype | None = None
    # the backward must be bitwise reproducible (so is every backward where torch.use_deterministic_algorithms
    # is on): the Triton backend's one pass, whose dQ sums land in any order, is not
    deterministic: bool = False

    @property
    def output_dtype(self) -> torch.dtype:
        return output_dtype(self.query.dtype, self.out_dtype)

    @property
    def deterministic_backward(self) -> bool:
        """Whether the backward must be bitwise reproducible: the call asked it, or torch's global switch
        (read when the backward is planned, as torch's own kernels read it)."""
        return self.deterministic or torch.are_deterministic_algorithms_enabled()


def output_dtype(query_dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> torch.dtype:
    """A forward's output dtype: ``out_dtype`` where given, bfloat16 for an FP8 query, else the query's."""
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if query_dtype in FP8_DTYPES else query_dtype


def check_call(
    backend: Backend,
    query, key, value, *,
    attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, dropout_seed=None,
    alignment="top_left", window=None, softcap=None, sinks=None, alibi_slopes=None, fp8=None, sequences=None,
    deterministic=False,
) -> Call:
    """Check one call of :func:`common.attention`; return it in 4-D form.

    ``fp8``: None where the entry point takes no FP8 input (an FP8 tensor is then an error), else
    the call's ``(q_descale, k_descale, v_descale, out_dtype)``. ``sequences``: a packed batch's
    sequence count (``common.varlen``), whose descales are (sequences, H_kv), one per sequence."""
    _check_types(query, key, value)
    fp8_inputs = _check_fp8_dtypes(query, key, value, fp8 is not None)
    is_causal = _check_flag("is_causal", is_causal)
    enable_gqa = _check_flag("enable_gqa", enable_gqa)
    return_lse = _check_flag("return_lse", return_lse)
    deterministic = _check_flag("deterministic", deterministic)
    if deterministic and not backend.kernels:  # (its backward is SDPA's, which only torch's global switch steers)
        raise ValueError(f"the {backend.name!r} backend cannot choose its backward, but the call passed "
                         f"deterministic=True (torch.use_deterministic_algorithms(True) makes SDPA's reproducible); "
                         f"use backend='triton' or backend='ninetoothed'")
    dropout_p = _check_dropout_p(dropout_p)
    device = _check_like_query(query, key, value, fp8_inputs)
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    B, H, Lq, D = query.shape
    Lk = key.shape[2]
    _check_shapes(backend, query.shape, key.shape, value.shape, enable_gqa)
    scale = _check_scale(scale, D)
    descales, out_dtype = None, None
    if fp8 is not None:
        descales, out_dtype = _check_fp8(fp8, query, key, value, unbatched, fp8_inputs, sequences)
    if attn_mask is not None:
        attn_mask, is_causal, alignment = _check_attn_mask(attn_mask, query, is_causal, alignment,
                                                           (B, H, Lq, Lk), unbatched, out_dtype or query.dtype)
    _check_capabilities(backend, query, key, value, attn_mask, return_lse)
    if not backend.supports(OFFSETS64):
        _check_offsets(backend, query=query, key=key, value=value, attn_mask=attn_mask,
                       output=(Lq * value.shape[3], 1))
    if dropout_seed is not None:
        _check_seed(backend, dropout_seed, device)
    if backend.kernels:
        _check_kernel_device(backend, device)
    bottom_right = _check_alignment(alignment)
    window = _check_window(window)
    if softcap is not None:
        softcap = _check_softcap(backend, softcap)
    if sinks is not None:
        _check_sinks(backend, sinks, H, device)
    if alibi_slopes is not None:
        alibi_slopes = _check_alibi(alibi_slopes, B, H, device)
    return Call(query, key, value, attn_mask, is_causal, scale, return_lse, unbatched, dropout_p, dropout_seed,
                window, bottom_right, softcap, sinks, alibi_slopes=alibi_slopes, descales=descales,
                out_dtype=out_dtype, deterministic=deterministic)


# -- scalars ------------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_flag(name: str, value) -> bool:
    """A bool, and only a bool (1 or "yes" is a mistake, not True)."""
    if value is not True and value is not False:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_real(name: str, value) -> float:
    """A finite real number (int, float, NumPy scalar) as a float."""
    if type(value) is float and math.isfinite(value):  # the common case, checked cheaply
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (int or float), got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_dropout_p(dropout_p) -> float:
    dropout_p = _check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a probability, 0 <= dropout_p <= 1, got {dropout_p}")
    return dropout_p


def _check_scale(scale, D: int) -> float:
    """None means SDPA's default, 1 / sqrt(D) (1 for an empty head dim)."""
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    return _check_real("scale", scale)


def _check_softcap(backend: Backend, softcap) -> float:
    softcap = _check_real("softcap", softcap)
    if not softcap > 0.0:
        raise ValueError(f"softcap must be a positive number (or None), got {softcap}")
    _require(backend, SOFTCAP, "cannot soft-cap scores", "softcap", softcap)
    return softcap


# -- query, key and value -----------------------------------------------------------------

def _check_types(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_like_query(query, key, value, fp8_inputs: bool = False) -> torch.device:
    """query 4-D or 3-D in a supported dtype; key and value with its dims, dtype and
    device (``fp8_inputs``: dtypes checked by :func:`_check_fp8_dtypes`). Returns the device."""
    ndim = query.ndim
    if ndim != 4 and ndim != 3:
        raise ValueError(
            f"query must be 4-D (batch, heads, seq_len, head_dim) or 3-D (heads, seq_len, head_dim), "
            f"got shape {tuple(query.shape)}"
        )
    for name, t in (("key", key), ("value", value)):
        if t.ndim != ndim:
            raise ValueError(f"{name} must have as many dims as query ({ndim}), got shape {tuple(t.shape)}")
    dtype = query.dtype
    if dtype not in SUPPORTED_DTYPES and not fp8_inputs:
        raise TypeError(f"query has dtype {_dtype_name(dtype)}; supported: "
                        + ", ".join(map(_dtype_name, SUPPORTED_DTYPES)))
    for name, t in (("key", key), ("value", value)):
        if t.dtype != dtype and not fp8_inputs:
            raise TypeError(
                f"{name} has dtype {_dtype_name(t.dtype)} but query has {_dtype_name(dtype)}: "
                "query, key and value must share one dtype"
            )
    device = query.device
    for name, t in (("key", key), ("value", value)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but query is on {device}: all must share one device")
    return device


def _check_shapes(backend: Backend, q_shape, k_shape, v_shape, enable_gqa: bool) -> None:
    """The 4-D shapes of one call: batch, heads, lengths and head dims agree."""
    B, H, _, D = q_shape
    _, H_kv, Lk, _ = k_shape
    if k_shape[0] != B or v_shape[0] != B:
        raise ValueError(f"batch sizes differ: query {B}, key {k_shape[0]}, value {v_shape[0]}")
    if v_shape[1] != H_kv:
        raise ValueError(f"key and value must have the same number of heads, got {H_kv} and {v_shape[1]}")
    if v_shape[2] != Lk:
        raise ValueError(f"key and value must have the same sequence length, got {Lk} and {v_shape[2]}")
    _check_heads(H, H_kv, enable_gqa)
    if k_shape[3] != D:
        raise ValueError(f"query and key must have the same head dim, got {D} and {k_shape[3]}")
    if backend.head_dims is not None:
        _check_head_dims(backend, D, v_shape[3])


def _check_heads(H: int, H_kv: int, enable_gqa: bool) -> None:
    if enable_gqa:
        if H_kv == 0 or H % H_kv != 0:
            raise ValueError(
                f"with enable_gqa=True the query heads ({H}) must be a multiple of the key/value heads ({H_kv})"
            )
    elif H_kv != H:
        raise ValueError(
            f"query has {H} heads but key and value have {H_kv}; pass enable_gqa=True for "
            "grouped-query attention (query heads a multiple of key/value heads)"
        )


def _check_head_dims(backend: Backend, D: int, Dv: int) -> None:
    low, high = backend.head_dims
    for name, d in (("query/key", D), ("value", Dv)):
        if not low <= d <= high:
            raise ValueError(
                f"{name} head dim {d} is not supported by the {backend.name!r} backend: "
                f"expected {low} <= head_dim <= {high}"
            )


# -- FP8 inputs -----------------------------------------------------------------------------

def _check_fp8_dtypes(query, key, value, accepted: bool) -> bool:
    """Whether the call has FP8 inputs: query, key and value in float8_e4m3fn, or a float16 or
    bfloat16 query with float8_e4m3fn keys and values. Any other 8-bit float, or FP8 where the
    entry point takes none (``accepted`` False), is a TypeError."""
    dtypes = (("query", query.dtype), ("key", key.dtype), ("value", value.dtype))
    if not any(dtype in _FLOAT8 for _, dtype in dtypes):
        return False
    for name, dtype in dtypes:
        if dtype in _FLOAT8 and dtype not in FP8_DTYPES:
            raise TypeError(f"{name} has dtype {_dtype_name(dtype)}; the only 8-bit float taken is float8_e4m3fn")
    if not accepted:
        raise TypeError(f"FP8 inputs (query, key, value: {', '.join(_dtype_name(d) for _, d in dtypes)}) are taken "
                        "by attention() (and FP8 caches by paged_attention() and append_kv()) so far; this function "
                        "takes float16, bfloat16 or float32")
    if key.dtype not in FP8_DTYPES or value.dtype not in FP8_DTYPES:
        raise TypeError(f"with FP8 inputs key and value must both be float8_e4m3fn, got key {_dtype_name(key.dtype)} "
                        f"and value {_dtype_name(value.dtype)}")
    if query.dtype not in FP8_DTYPES + (torch.float16, torch.bfloat16):
        raise TypeError(f"with float8_e4m3fn keys and values query must be float8_e4m3fn, float16 or bfloat16, "
                        f"got {_dtype_name(query.dtype)}")
    return True


def _check_descale(name, d, shape, per: str, device, device_owner: str) -> None:
    """One given descale tensor: float32 of ``shape`` (one per ``per`` and key/value head,
    FlashAttention-3's convention) on ``device`` (``device_owner``'s), needing no gradient (FP8
    attention is forward-only)."""
    if d.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got {_dtype_name(d.dtype)}")
    if tuple(d.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} (one descale per {per} and key/value head, "
                         f"FlashAttention-3's convention), got {tuple(d.shape)}")
    if d.device != device:
        raise ValueError(f"{name} is on {d.device} but {device_owner} is on {device}")
    if d.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but FP8 attention is forward-only: descales get no gradient")


def _check_fp8(fp8, query, key, value, unbatched: bool, fp8_inputs: bool, sequences: int | None = None):
    """``(descales, out_dtype)`` of a call that may take FP8 inputs: ``fp8`` is its
    ``(q_descale, k_descale, v_descale, out_dtype)``. Descales: None (1) or float32 tensors
    (B, H_kv) ((H_kv,) for 3-D inputs; (sequences, H_kv) for a packed batch) on the query's
    device, returned as given but 2-D, only for FP8 tensors; forward only (nothing may need a
    gradient). descales is None without FP8 inputs."""
    *given, out_dtype = fp8
    B, H_kv = key.shape[0], key.shape[1]
    names = ("q_descale", "k_descale", "v_descale")
    descales = []
    for name, input_name, t, d in zip(names, ("query", "key", "value"), (query, key, value), given):
        if d is None:
            descales.append(None)
            continue
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(d).__name__}")
        if t.dtype not in FP8_DTYPES:
            raise ValueError(f"{name} was given but {input_name} is {_dtype_name(t.dtype)}: "
                             "descales go with float8_e4m3fn inputs")
        if sequences is not None:
            _check_descale(name, d, (sequences, H_kv), "sequence", query.device, "query")
        else:
            _check_descale(name, d, (H_kv,) if unbatched else (B, H_kv), "batch", query.device, "query")
        descales.append(d.unsqueeze(0) if unbatched else d)
    if query.dtype in FP8_DTYPES:
        out_dtype = output_dtype(query.dtype, out_dtype)
        if out_dtype not in FP8_QUERY_OUT_DTYPES:
            raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16 for an FP8 query, got {out_dtype}")
    elif out_dtype is not None and out_dtype != query.dtype:
        raise ValueError(f"out_dtype={out_dtype} was given for a {_dtype_name(query.dtype)} query, whose output has "
                         "its dtype: out_dtype chooses the output of an FP8 query only")
    if not fp8_inputs:
        return None, None
    if torch.is_grad_enabled():
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.requires_grad:
                raise ValueError(f"{name} requires grad, but attention with FP8 inputs is forward-only; "
                                 "run it under torch.no_grad() or detach the inputs")
    return tuple(descales), out_dtype


# -- what the backend can do --------------------------------------------------------------

def _require(backend: Backend, capability: str, lacking: str, argument: str, value) -> None:
    """A clear error when ``backend`` lacks ``capability``: what it cannot do, the argument
    and value that asked for it, and the backends that can."""
    if not backend.supports(capability):
        usable = " or ".join(f"backend={name!r}" for name, b in BACKENDS.items() if b.supports(capability))
        raise ValueError(f"the {backend.name!r} backend {lacking}, but the call passed {argument}"
                         f"{_shown(value)}; use {usable}")


def _shown(value) -> str:
    """A value as a message shows it after its argument's name: ``=5.0``, or a tensor's kind."""
    if isinstance(value, torch.Tensor):
        return f" (a {_dtype_name(value.dtype)} tensor of shape {tuple(value.shape)})"
    return f"={value!r}"


def _check_capabilities(backend: Backend, query, key, value, attn_mask, return_lse: bool) -> None:
    """The log-sum-exp and gradients asked for are ones the backend gives."""
    if return_lse:
        _require(backend, LSE, "cannot return the log-sum-exp", "return_lse", True)
    if torch.is_grad_enabled():
        _check_grad(backend, query, key, value, attn_mask)


def _check_grad(backend: Backend, query, key, value, attn_mask) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.requires_grad and not backend.supports(BACKWARD):
            raise ValueError(f"{name} requires grad, but the {backend.name!r} backend has no backward pass")
    if attn_mask is not None and attn_mask.requires_grad and backend.kernels:
        raise ValueError(
            "attn_mask requires grad, but an attention mask gets no gradient from the "
            f"{backend.name!r} backend; pass attn_mask.detach() (or use backend='torch')"
        )


def _check_kernel_device(backend: Backend, device: torch.device) -> None:
    """A kernel backend runs on CUDA tensors, or on CPU tensors under Triton's interpreter."""
    if device.type == "cuda":
        return
    if device.type == "cpu":
        if not backend.interpreted():
            raise ValueError(
                f"the {backend.name!r} backend got CPU tensors but Triton is compiling for a GPU. "
                "Move the tensors to CUDA, or run on the CPU under Triton's interpreter: set the "
                "environment variable TRITON_INTERPRET=1 before starting Python (slow; for tests)"
            )
        return
    raise ValueError(f"the {backend.name!r} backend runs on CUDA devices (or the CPU interpreter), got {device}")


# -- attn_mask ----------------------------------------------------------------------------

def _check_attn_mask(attn_mask, query, is_causal: bool, alignment, full_shape, unbatched: bool, float_dtype=None):
    """``(mask, is_causal, alignment)``: a mask tensor as a (B, H, Lq, Lk) view, or a
    CausalBias as the causal flag and alignment it means (and no mask). A floating mask is
    float32 or ``float_dtype`` (the output's dtype; None: the query's)."""
    if _is_causal_bias(attn_mask):
        is_causal, alignment = _from_causal_bias(attn_mask, is_causal, alignment, *full_shape[2:])
        return None, is_causal, alignment
    return (_check_mask(attn_mask, query, is_causal, full_shape, unbatched, float_dtype or query.dtype),
            is_causal, alignment)


def _is_causal_bias(attn_mask) -> bool:
    # Only a tensor subclass can be one, and only once its module is imported
    # (importing it here would pull torch._dynamo into every start-up).
    if type(attn_mask) is torch.Tensor or "torch.nn.attention.bias" not in sys.modules:
        return False
    return isinstance(attn_mask, sys.modules["torch.nn.attention.bias"].CausalBias)


def _from_causal_bias(bias, is_causal, alignment, Lq: int, Lk: int) -> tuple[bool, str]:
    """SDPA's CausalBias objects (``causal_upper_left`` / ``causal_lower_right``) as what
    they mean: is_causal with top-left or bottom-right alignment. No mask tensor is read
    (the subclass's data is not a mask)."""
    from torch.nn.attention.bias import CausalVariant

    if is_causal:
        raise ValueError("attn_mask is a CausalBias, which is already causal: pass is_causal=False with it")
    if (bias.seq_len_q, bias.seq_len_kv) != (Lq, Lk):
        raise ValueError(f"attn_mask is a CausalBias for {bias.seq_len_q} query rows and {bias.seq_len_kv} keys, "
                         f"but the call has {Lq} and {Lk}")
    implied = "top_left" if bias.variant == CausalVariant.UPPER_LEFT else "bottom_right"
    if alignment != "top_left" and alignment != implied:
        raise ValueError(f"attn_mask is a CausalBias that means alignment={implied!r}, but alignment={alignment!r} "
                         "was passed too")
    return True, implied


def _check_mask(attn_mask, query, is_causal, full_shape, unbatched, float_dtype) -> torch.Tensor:
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if is_causal:
        # SDPA's math backend: "Explicit attn_mask should not be set when is_causal=True"
        raise ValueError("attn_mask must be None when is_causal=True (SDPA rejects the pair too)")
    if attn_mask.dtype not in (torch.bool, torch.float32, float_dtype):
        like = "the query's" if float_dtype == query.dtype else "the output's"
        raise TypeError(
            f"attn_mask has dtype {_dtype_name(attn_mask.dtype)}; expected bool (True = take part) "
            f"or a floating mask to add, in float32 or {like} dtype ({_dtype_name(float_dtype)})"
        )
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    target = full_shape[1:] if unbatched else full_shape
    try:
        broadcast = torch.broadcast_shapes(attn_mask.shape, target)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(target):
        names = "(heads, Lq, Lk)" if unbatched else "(batch, heads, Lq, Lk)"
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {names} = {tuple(target)}"
        )
    # A view, never a copy: broadcast dims get stride 0.
    return attn_mask.expand(full_shape)


# -- dropout's seed, alignment, window, sinks ---------------------------------------------

def _check_seed(backend: Backend, seed, device: torch.device) -> None:
    if not backend.kernels:
        raise ValueError(
            f"dropout_seed is not supported by the {backend.name!r} backend (SDPA draws its own dropout mask)"
        )
    if not isinstance(seed, torch.Tensor):
        raise TypeError(f"dropout_seed must be a torch.Tensor or None, got {type(seed).__name__}")
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(
            f"dropout_seed must be an int64 tensor of one element, got {_dtype_name(seed.dtype)} "
            f"of shape {tuple(seed.shape)}"
        )
    if seed.device != device:
        raise ValueError(f"dropout_seed is on {seed.device} but query is on {device}")


ALIGNMENTS = ("top_left", "bottom_right")


def _check_alignment(alignment) -> bool:
    """Whether query rows sit bottom-right."""
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {', '.join(map(repr, ALIGNMENTS))}, got {alignment!r}")
    return alignment == "bottom_right"


def _check_window(window):
    """None, or ``(left, right)`` as ints; a window unbounded on both sides is None."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints, got {window!r}")
    for side, n in zip(("left", "right"), window):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"window's {side} bound must be an int (-1: unbounded), got {type(n).__name__}")
        if n < -1:
            raise ValueError(f"window's {side} bound must be >= 0, or -1 for unbounded, got {n}")
    return None if window[0] == window[1] == -1 else (int(window[0]), int(window[1]))


def _check_sinks(backend: Backend, sinks, H: int, device) -> None:
    _require(backend, SINKS, "has no attention sinks", "sinks", sinks)
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"sinks must be a float tensor (float16, bfloat16 or float32), got {_dtype_name(sinks.dtype)}")
    if tuple(sinks.shape) != (H,):
        raise ValueError(f"sinks must have shape ({H},): one logit per query head, got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {device}")


def _check_alibi(slopes, B: int, H: int, device) -> torch.Tensor:
    """ALiBi's slopes, (H,) or (B, H) float32 on the query's device, as a detached (B, H) view
    (they get no gradient: a slopes tensor that requires grad is used as a constant). Their values
    are not read here: that would cost a host sync every call (a non-finite slope gives non-finite
    scores, as a non-finite mask does)."""
    return check_slopes(slopes, B, "batch", H, device).expand(B, H)


def check_slopes(slopes, rows: int, per: str, H: int, device) -> torch.Tensor:
    """ALiBi's slopes checked: a float32 tensor of shape (H,) or (rows, H) (a slope per query head, or
    per ``per`` and query head) on ``device``; returned detached, as given."""
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be a float32 tensor, got {_dtype_name(slopes.dtype)}")
    if tuple(slopes.shape) not in ((H,), (rows, H)):
        raise ValueError(f"alibi_slopes must have shape ({H},) or ({rows}, {H}): one slope per query head "
                         f"(or per {per} and query head), got {tuple(slopes.shape)}")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes is on {slopes.device} but query is on {device}")
    return slopes.detach()


# -- 32-bit offsets -----------------------------------------------------------------------

def span(t, first: int = 0) -> int:
    """How many elements a tensor's indexing reaches from its start, its dimensions from
    ``first`` on: 1 + the largest element offset they make."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape[first:], t.stride()[first:]))


def slice_span(t) -> int:
    """How many elements a tensor's indexing reaches within one index of its first two
    dimensions (one batch and head of every tensor a call passes). A tuple ``(n, 1)`` stands
    for a contiguous tensor still to be made whose part for one batch and head holds ``n``
    elements."""
    return t[0] if isinstance(t, tuple) else span(t, 2)


def in_wide_storage(*tensors) -> bool:
    """Whether one of these tensors (None: absent) lies in a storage of OFFSET_LIMIT elements or more:
    what its indexing can reach is within its storage, a bound far cheaper than :func:`span` on a
    path a decode step takes (the launches that take 64-bit offsets only then)."""
    return any(t is not None and t.untyped_storage().nbytes() >= OFFSET_LIMIT * t.element_size() for t in tensors)


def within_offsets(backend: Backend, *tensors) -> bool:
    """Whether ``backend`` indexes these tensors (None: absent): a backend with 64-bit offsets
    throughout any, one without each tensor whose part for one batch and head spans fewer than
    OFFSET_LIMIT elements (:func:`slice_span`)."""
    return backend.supports(OFFSETS64) or all(t is None or slice_span(t) < OFFSET_LIMIT for t in tensors)


def _check_offsets(backend: Backend, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and slice_span(t) >= OFFSET_LIMIT:
            raise ValueError(
                f"the {backend.name!r} backend indexes within one batch and head with 32-bit offsets "
                f"(NineToothed's generated code; its batch and head offsets are 64-bit), so each tensor's part "
                f"for one batch and head must span fewer than 2**31 = {OFFSET_LIMIT} elements, but {name}'s "
                f"spans {slice_span(t)}; use backend='triton', or split the call (e.g. over the sequence)"
            )


# -- attention_backward -------------------------------------------------------------------

def check_backward(backend: Backend, call: Call, grad_out, out, lse, grad_lse):
    """Check what :func:`common.attention_backward` takes besides the forward's
    arguments; return ``(grad_out, out, lse, grad_lse)`` in 4-D form."""
    _check_backward_kernels(backend)
    B, H, Lq, _ = call.query.shape
    Dv = call.value.shape[3]
    dtype = call.query.dtype
    grad_out = _check_backward_tensor(call, "grad_out", grad_out, (B, H, Lq, Dv), dtype)
    out = _check_backward_tensor(call, "out", out, (B, H, Lq, Dv), dtype)
    lse = _check_backward_tensor(call, "lse", lse, (B, H, Lq), torch.float32)
    if grad_lse is not None:
        grad_lse = _check_backward_tensor(call, "grad_lse", grad_lse, (B, H, Lq), torch.float32)
    if not backend.supports(OFFSETS64):
        _check_offsets(backend, grad_out=grad_out, out=out, lse=lse, grad_lse=grad_lse)
    if call.dropout_p > 0.0 and call.dropout_seed is None:
        raise ValueError(
            "dropout_p > 0 needs the forward's dropout_seed: the backward regenerates the forward's mask from it"
        )
    return grad_out, out, lse, grad_lse


def _check_backward_kernels(backend: Backend) -> None:
    """The backward is called directly: only a kernel backend with backward kernels has one."""
    if not (backend.kernels and backend.supports(BACKWARD)):
        usable = [name for name, b in BACKENDS.items() if b.kernels and b.supports(BACKWARD)]
        raise ValueError(
            f"the {backend.name!r} backend has no backward kernels to call directly; "
            f"use one of {', '.join(map(repr, usable))}"
        )


def _check_backward_tensor(call: Call, name: str, t, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """One of the backward's tensors, of ``shape`` (less its batch dim for an unbatched
    call), ``dtype`` and the query's device; returned with a batch dim."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if call.unbatched and t.ndim == len(shape) - 1:
        t = t.unsqueeze(0)
    if tuple(t.shape) != shape:
        expected = shape[1:] if call.unbatched else shape
        raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape[call.unbatched:])}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {_dtype_name(dtype)}, got {_dtype_name(t.dtype)}")
    if t.device != call.query.device:
        raise ValueError(f"{name} is on {t.device} but query is on {call.query.device}")
    return t
