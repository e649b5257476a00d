"""The public functions: ``attention()`` and ``attention_backward()``.

Each call: validation (``common.validation``, errors before anything runs),
the backend (``common.backends``), then either the backend's registered
operator (``common.ops``; when an input needs a gradient or ``torch.compile``
is tracing) or, where nobody is watching, the same operator body called
directly. The body plans the call (``common.plan``) and the backend launches
its kernels for that plan. A plain call (no mask, dropout, window, soft-capping,
sinks or ALiBi) runs the plan kept for its layout (``common.reuse.PLANS``), made by
the first call of that layout: later ones neither validate nor plan again.
"""

from __future__ import annotations

import torch

from common import ops
from common.backends import resolve
from common.reuse import PLANS, AttentionPlan, PlanCache, layout_of
from common.validation import FP8_DTYPES, check_backward, check_call


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    backend: str | None = None,
    return_lse: bool = False,
    dropout_seed: torch.Tensor | None = None,
    alignment: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    deterministic: bool = False,
):
    """Scaled-dot-product attention, as ``torch.nn.functional.scaled_dot_product_attention``.

    ``softmax(query @ key.T * scale + mask) @ value``, computed by the chosen
    backend without materialising the score matrix. Differentiable with
    respect to query, key and value (all backends), and traceable by
    ``torch.compile`` (one operator per kernel backend).

    Args:
        query: (B, H, Lq, D) or (H, Lq, D); float16, bfloat16 or float32; any strides.
            Or float8_e4m3fn (forward only; see q_descale).
        key: (B, H_kv, Lk, D) or (H_kv, Lk, D); same dtype and device as query (FP8: key
            and value float8_e4m3fn with a float8_e4m3fn, float16 or bfloat16 query).
        value: (B, H_kv, Lk, Dv) or (H_kv, Lk, Dv); Dv may differ from D.
            The kernel backends take head dims 1 <= D, Dv <= 256.
        is_causal: mask with SDPA's top-left alignment, ``ones(Lq, Lk).tril(0)``:
            query row i sees keys 0..i, also when Lq != Lk.
        scale: multiplies the scores; None means 1/sqrt(D). Any finite float.
        attn_mask: None; a bool tensor (True = takes part); or a float tensor
            (float32 or query's dtype) added to the scaled scores. Broadcastable
            to (B, H, Lq, Lk); read through its strides, never copied. Not
            together with is_causal (SDPA rejects that pair too). A row whose
            every key is masked out gives 0 (and zero gradients), as SDPA's
            math backend does. Gets no gradient: a mask that requires grad is
            rejected by the kernel backends.
        dropout_p: the probability of dropping each attention weight, in [0, 1]
            (SDPA's semantics: applied whenever > 0, training or not; kept
            weights are scaled by 1 / (1 - dropout_p); the log-sum-exp is that
            of the scores before dropout). The kernel backends draw the mask
            from Philox, counted by each score's position, and regenerate it
            in the backward (never stored).
        enable_gqa: allow H_kv < H (grouped-query / multi-query attention); H
            must be a multiple of H_kv; query head h reads K/V head h // (H // H_kv).
        backend: "triton", "ninetoothed" or "torch" (SDPA itself). When None:
            the innermost ``use_backend(...)`` block, else the environment
            variable ATTENTION_BACKEND, else "triton".
        return_lse: also return the natural-log log-sum-exp of each query row's
            scaled, masked scores: float32, shape (B, H, Lq) or (H, Lq); -inf
            for a row whose every key is masked out. Differentiable too.
        dropout_seed: kernel backends: the dropout mask's seed, an int64 tensor
            of one element on the inputs' device; the same seed gives the same
            mask. None: drawn from the device's default generator, so
            ``torch.manual_seed`` reproduces a run. Unused when dropout_p = 0.
        alignment: where query rows sit against the keys: "top_left" (row i
            at position i, SDPA's is_causal) or "bottom_right" (row i at
            i + Lk - Lq: the last query row is the last key, a KV cache's and
            FlashAttention's convention). Key j sits at position j.
        window: None, or (left, right): row i sees only the keys within left
            positions before and right after its position (-1: unbounded on
            that side, FlashAttention's convention; (left, 0) with is_causal is
            a sliding window). Combines with is_causal and attn_mask; the
            kernels never visit key blocks outside the window.
        softcap: None, or a positive float: each scaled score s becomes
            softcap * tanh(s / softcap) before any mask (Gemma 2's attention
            logit soft-capping); differentiable.
        sinks: None, or a float tensor (H,): one learned logit per query head
            that joins every row's softmax denominator and contributes no
            value (gpt-oss's attention sinks); the log-sum-exp includes it, a
            row with no visible key gives 0. Differentiable (sinks.grad).
        alibi_slopes: None, or a float32 tensor (H,) or (B, H) on the query's
            device (ALiBi, FlashAttention's convention; read as they are, with
            no host sync to check their values): adds
            ``-slope[b, h] * |pos_i - j|`` to the score of query row i and key j
            (pos_i under ``alignment``), after soft-capping and before any mask
            (a masked score stays masked). The slopes get no gradient (as in
            FlashAttention): a slopes tensor that requires grad is used as a
            constant.
        q_descale, k_descale, v_descale: FP8 inputs' descales (FlashAttention-3's
            convention): None (1), or a float32 tensor (B, H_kv) ((H_kv,) for 3-D
            inputs) on the query's device; an input's real value is its stored
            value times the descale of its batch and key/value head (a query head
            takes its group's). Only for float8_e4m3fn inputs. Scores are the
            float32 sums of the FP8 products times scale · q_descale · k_descale;
            for the P·V product the probabilities are rounded to e4m3 where the
            query is FP8 too (FlashAttention-3's choice; ``Planner.fp8_pv``), and
            values are widened to the query's dtype where it is 16-bit; the
            output is multiplied by v_descale. Forward only: an input that
            requires grad is an error. The kernel backends read the descales on
            the GPU (no host sync); "torch" dequantizes and calls SDPA.
        out_dtype: the output's dtype for an FP8 query: torch.bfloat16 (None) or
            torch.float16. Otherwise None or the query's dtype.
        deterministic: the backward must give the same gradients bit for bit from
            run to run (FlashAttention's flag; ``torch.use_deterministic_algorithms(True)``
            asks it of every call). False lets the "triton" backend take its one-pass
            backward on sm_90 where it runs (README: which backward runs where), whose
            dQ is summed in whatever order its tiles finish. The "ninetoothed"
            backward is always deterministic; "torch" (SDPA's own backward) refuses True.

    Returns:
        The output, (B, H, Lq, Dv) or (H, Lq, Dv), in the inputs' dtype (an FP8 query's:
        out_dtype); with ``return_lse=True`` the pair ``(output, lse)``.

    Raises:
        TypeError, ValueError: for bad input, before any kernel launches.
    """
    if (dropout_seed is None and window is None and softcap is None and sinks is None and alibi_slopes is None
            and deterministic is False and type(dropout_p) is not bool and dropout_p == 0 and alignment == "top_left"
            and (attn_mask is None or (type(attn_mask) is torch.Tensor and is_causal is False))):
        descales = None
        if q_descale is not None or k_descale is not None or v_descale is not None or out_dtype is not None:
            descales = (q_descale, k_descale, v_descale, out_dtype)
        again = _again(query, key, value, is_causal, scale, enable_gqa, backend, return_lse, descales, attn_mask)
        if again is not None:
            return again
    return full_attention(query, key, value, is_causal, scale, attn_mask=attn_mask, dropout_p=dropout_p,
                          enable_gqa=enable_gqa, backend=backend, return_lse=return_lse, dropout_seed=dropout_seed,
                          alignment=alignment, window=window, softcap=softcap, sinks=sinks,
                          alibi_slopes=alibi_slopes, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                          out_dtype=out_dtype, deterministic=deterministic)


def full_attention(query, key, value, is_causal=False, scale=None, *, attn_mask=None, dropout_p=0.0,
                   enable_gqa=False, backend=None, return_lse=False, dropout_seed=None, alignment="top_left",
                   window=None, softcap=None, sinks=None, alibi_slopes=None, q_descale=None, k_descale=None,
                   v_descale=None, out_dtype=None, deterministic=False):
    """:func:`attention` without a kept plan: validated, planned and launched afresh (through
    the backend's operator where autograd or ``torch.compile`` watches)."""
    chosen = resolve(backend)
    call = check_call(
        chosen, query, key, value,
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, dropout_seed=dropout_seed,
        alignment=alignment, window=window, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
        fp8=(q_descale, k_descale, v_descale, out_dtype), deterministic=deterministic,
    )
    if call.dropout_p > 0.0 and call.dropout_seed is None and chosen.kernels:
        call.dropout_seed = ops.new_seed(call.query.device)
    if call.descales is not None and chosen.kernels and torch.compiler.is_compiling():
        # forward only (validated): the operator itself, without autograd's Function
        out, lse = ops.OPS[chosen.name][0](call.query, call.key, call.value, call.attn_mask, call.is_causal,
                                           call.scale, call.dropout_p, call.dropout_seed, *ops.extras(call),
                                           call.sinks, None, call.alibi_slopes, None, *call.descales,
                                           call.out_dtype)
    elif chosen.kernels and (torch.compiler.is_compiling() or _needs_grad(call)):
        out, lse = ops.FUNCTIONS[chosen.name].apply(call.query, call.key, call.value, call.attn_mask,
                                                    call.is_causal, call.scale, call.dropout_p, call.dropout_seed,
                                                    *ops.extras(call), call.sinks, None, call.alibi_slopes, None,
                                                    call.deterministic)
    else:
        out, lse = ops.forward(chosen, call, with_lse=call.return_lse)
    if call.unbatched:
        out = out[0]
        lse = lse[0] if lse is not None else None
    return (out, lse) if call.return_lse else out


def attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
    backend: str | None = None,
    grad_lse: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
    alignment: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
):
    """The gradients of :func:`attention` with respect to query, key and value.

    A building block for code that schedules attention itself (context
    parallelism, custom autograd functions): it runs the chosen kernel
    backend's backward kernels once, with no autograd graph.

    Args:
        grad_out: (B, H, Lq, Dv) or (H, Lq, Dv): the gradient of the output.
        query, key, value, attn_mask, is_causal, scale, enable_gqa, backend,
            alignment, window, softcap, alibi_slopes: as given to :func:`attention` for the forward call.
        deterministic: as :func:`attention`'s: gradients bit for bit the same from run to run.
        out: the forward's output, (B, H, Lq, Dv) or (H, Lq, Dv).
        lse: the forward's log-sum-exp (``return_lse=True``), float32,
            (B, H, Lq) or (H, Lq). (With attention sinks it includes them, which
            is all the backward kernels need of them.)
        grad_lse: optional gradient of the log-sum-exp, same shape as lse.
        dropout_p, dropout_seed: the forward's; with dropout_p > 0 the seed
            the forward used is required (its mask is regenerated from it).

    Returns:
        ``(dq, dk, dv)``, shaped and typed like query, key and value (contiguous).
        Rows with no visible key contribute nothing; keys no row sees get 0.

    Raises:
        TypeError, ValueError: for bad input (or a backend without a backward
        kernel), before any kernel launches.
    """
    chosen = resolve(backend)
    call = check_call(
        chosen, query, key, value,
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa, return_lse=False, dropout_seed=dropout_seed,
        alignment=alignment, window=window, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
    )
    grad_out, out, lse, grad_lse = check_backward(chosen, call, grad_out, out, lse, grad_lse)
    if torch.compiler.is_compiling():
        grads = ops.OPS[chosen.name][1](grad_out, call.query, call.key, call.value, call.attn_mask, out, lse,
                                        grad_lse, call.is_causal, call.scale, call.dropout_p, call.dropout_seed,
                                        *ops.extras(call), None, call.alibi_slopes, None, call.deterministic)
    else:
        grads = ops.backward(chosen, call, out, lse, grad_out, grad_lse)
    return tuple(g[0] for g in grads) if call.unbatched else tuple(grads)


def _again(query, key, value, is_causal, scale, enable_gqa, backend, return_lse, descales=None, attn_mask=None):
    """The result of a plain or masked kernel-backend call through the plan kept for its layout
    (:data:`common.reuse.PLANS`, made by this call where it is the layout's first); None where
    the full path must run. ``descales``: None, or FP8 inputs' ``(q_descale, k_descale,
    v_descale, out_dtype)``, each descale None or a tensor (its layout part of the call's);
    ``attn_mask``: None or a tensor (its layout part of the call's, and no gradient asked of it)."""
    if torch.compiler.is_compiling():  # first: torch.compile traces none of the rest
        return None
    if not _plain_types(query, key, value, is_causal, scale, enable_gqa, return_lse, descales):
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                    or (attn_mask is not None and attn_mask.requires_grad)):
        return None
    chosen = resolve(backend)
    if not chosen.kernels:
        return None
    if descales is None and (key.dtype in FP8_DTYPES or query.dtype in FP8_DTYPES):
        descales = (None, None, None, None)  # FP8 inputs whose descales are all 1
    layout = layout_of(chosen, is_causal, scale, enable_gqa, return_lse, query, key, value, descales, attn_mask)
    plan = PLANS.get(layout)
    if plan is None and attn_mask is not None and layout not in _MASKED_ONCE:
        # A masked layout's plan is kept from its second call: a masked decode loop over a growing cache
        # meets every layout once (the mask's length is the keys'), and keeping each would only cost it.
        _MASKED_ONCE.put(layout, True)
        return None
    if plan is None:
        call = check_call(chosen, query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                          fp8=descales or (None, None, None, None))
        arguments = dict(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                         backend=chosen.name)
        if descales is not None:
            arguments["out_dtype"] = descales[3]
        plan = AttentionPlan(chosen, call, layout, arguments, attn_mask)
        PLANS.put(layout, plan)
    return plan.results(query, key, value, None if descales is None else descales[:3], attn_mask)


_MASKED_ONCE = PlanCache(256)  # the masked layouts met once (_again)


def _plain_types(query, key, value, is_causal, scale, enable_gqa, return_lse, descales) -> bool:
    """Plain tensors and arguments of exact types: not subclasses, nor values whose validation
    may fail on a type that compares equal (True for 1.0, 1 for True); FP8 inputs' descales and
    output dtype of exact types too (each None or a plain tensor; None or a dtype), and no
    descale that asks for a gradient (the full path says FP8 is forward-only)."""
    if not (type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor
            and type(is_causal) is bool and type(enable_gqa) is bool and type(return_lse) is bool
            and (scale is None or type(scale) is float)):
        return False
    if descales is None:
        return True
    *tensors, out_dtype = descales
    return (all(d is None or (type(d) is torch.Tensor and not d.requires_grad) for d in tensors)
            and (out_dtype is None or type(out_dtype) is torch.dtype))


def _needs_grad(call) -> bool:
    return torch.is_grad_enabled() and (
        call.query.requires_grad or call.key.requires_grad or call.value.requires_grad
        or (call.sinks is not None and call.sinks.requires_grad))

