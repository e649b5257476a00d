"""The public functions: ``attention()`` and ``attention_backward()``.

Each call: validation (``common.validation``, errors before anything runs),
the backend (``common.backends``), then either the backend's registered
operator (``common.ops``; when an input needs a gradient or ``torch.compile``
is tracing) or, where nobody is watching, the same operator body called
directly. The body plans the call (``common.plan``) and the backend launches
its kernels for that plan.
"""

from __future__ import annotations

import torch

from common import ops
from common import plan as planning
from common.backends import OFFSETS64, resolve
from common.validation import OFFSET_LIMIT, check_backward, check_call, span


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
):
    """Scaled-dot-product attention, as ``torch.nn.functional.scaled_dot_product_attention``.

    ``softmax(query @ key.T * scale + mask) @ value``, computed by the chosen
    backend without materialising the score matrix. Differentiable with
    respect to query, key and value (all backends), and traceable by
    ``torch.compile`` (one operator per kernel backend).

    Args:
        query: (B, H, Lq, D) or (H, Lq, D); float16, bfloat16 or float32; any strides.
        key: (B, H_kv, Lk, D) or (H_kv, Lk, D); same dtype and device as query.
        value: (B, H_kv, Lk, Dv) or (H_kv, Lk, Dv); Dv may differ from D.
            The kernel backends take head dims 16 <= D, Dv <= 256.
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

    Returns:
        The output, (B, H, Lq, Dv) or (H, Lq, Dv), in the inputs' dtype; with
        ``return_lse=True`` the pair ``(output, lse)``.

    Raises:
        TypeError, ValueError: for bad input, before any kernel launches.
    """
    if (attn_mask is None and dropout_seed is None and window is None and softcap is None and sinks is None
            and type(dropout_p) is not bool and dropout_p == 0 and alignment == "top_left"):
        again = _again(query, key, value, is_causal, scale, enable_gqa, backend, return_lse)
        if again is not None:
            return again
    chosen = resolve(backend)
    call = check_call(
        chosen, query, key, value,
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, dropout_seed=dropout_seed,
        alignment=alignment, window=window, softcap=softcap, sinks=sinks,
    )
    if call.dropout_p > 0.0 and call.dropout_seed is None and chosen.kernels:
        call.dropout_seed = ops.new_seed(call.query.device)
    if chosen.kernels and (torch.compiler.is_compiling() or _needs_grad(call)):
        out, lse = ops.FUNCTIONS[chosen.name].apply(call.query, call.key, call.value, call.attn_mask,
                                                    call.is_causal, call.scale, call.dropout_p, call.dropout_seed,
                                                    *ops.extras(call), call.sinks)
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
):
    """The gradients of :func:`attention` with respect to query, key and value.

    A building block for code that schedules attention itself (context
    parallelism, custom autograd functions): it runs the chosen kernel
    backend's backward kernels once, with no autograd graph.

    Args:
        grad_out: (B, H, Lq, Dv) or (H, Lq, Dv): the gradient of the output.
        query, key, value, attn_mask, is_causal, scale, enable_gqa, backend,
            alignment, window, softcap: as given to :func:`attention` for the forward call.
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
        alignment=alignment, window=window, softcap=softcap,
    )
    grad_out, out, lse, grad_lse = check_backward(chosen, call, grad_out, out, lse, grad_lse)
    if torch.compiler.is_compiling():
        grads = ops.OPS[chosen.name][1](grad_out, call.query, call.key, call.value, call.attn_mask, out, lse,
                                        grad_lse, call.is_causal, call.scale, call.dropout_p, call.dropout_seed,
                                        *ops.extras(call))
    else:
        grads = ops.backward(chosen, call, out, lse, grad_out, grad_lse)
    return tuple(g[0] for g in grads) if call.unbatched else tuple(grads)


# A loop of calls with one layout (the same shapes in every layer of a model, a fixed-size
# benchmark) validates and plans the same thing each time: what validation decides and what
# the plan holds depend only on the arguments and on the tensors' shapes, strides, dtypes
# and devices. The plain calls (no mask, dropout, window, soft-capping or sinks; nothing
# that needs a gradient; not compiling) keep the template of the first call of each layout
# (common.plan.template_of); later ones only allocate their outputs and launch. Calls that
# are not causal are also found by their layout less the keys' length and strides (a decode
# loop's cache grows by a token a step): those check what depends on the keys' length and
# plan their launch again (config, splits), nothing else.
_templates: dict = {}  # the exact layout -> template
_growing: dict = {}  # the layout less the keys' length and strides (calls that are not causal) -> template


def _again(query, key, value, is_causal, scale, enable_gqa, backend, return_lse):
    """The result of a plain kernel-backend call through the template of its layout (made
    by this call where it is the layout's first); None where the full path must run."""
    if torch.compiler.is_compiling():  # first: torch.compile traces none of the rest
        return None
    if (type(query) is not torch.Tensor or type(key) is not torch.Tensor or type(value) is not torch.Tensor
            or type(is_causal) is not bool or type(enable_gqa) is not bool or type(return_lse) is not bool
            or not (scale is None or type(scale) is float)):
        return None  # subclasses, and arguments whose validation may fail on a type equal in value
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    chosen = resolve(backend)
    settings = planning.reuse_key()
    if not chosen.kernels or settings is None:
        return None
    head = (chosen.name, chosen.interpreted(), settings, is_causal, scale, enable_gqa, return_lse,
            query.shape, query.stride(), query.dtype, query.device, key.dtype, key.device, value.dtype, value.device)
    exact = (head, key.shape, key.stride(), value.shape, value.stride())
    unbatched = query.ndim == 3
    template = _templates.get(exact)
    other_keys = False
    growing = None
    # (causal calls drop the keys no row sees: their plan depends on the keys' length)
    if template is None and not is_causal:
        growing = (head, key.shape[:-2], key.shape[-1], value.shape[:-2], value.shape[-1])
        template = _growing.get(growing)
        other_keys = template is not None
        if other_keys and not _keys_fit(chosen, key, value):
            return None  # the full path says what is wrong
    if template is None:
        call = check_call(chosen, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa, return_lse=return_lse)
        out, lse, template = ops.forward(chosen, call, with_lse=return_lse, template=True)
        if template is not None:
            planning.remember(_templates, exact, template)
            if growing is not None:
                planning.remember(_growing, growing, template)
    else:
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        # The exact layout's second call binds its launch (common.plan.bind_launch); later
        # ones allocate their outputs and launch that (plan.launch_bound), nothing else.
        # Growing keys launch again what the last growing call launched while their plan
        # would not change (plan.launch_grown).
        if other_keys:
            bound = None
            results = ops.forward_grown(chosen, template, query, key, value)
        else:
            bound = template.bound[0]
            results = ops.forward_bound(chosen, bound, query, key, value) if bound else None
        if results is None:
            results = ops.forward_again(chosen, template, query, key, value, other_keys=other_keys,
                                        bind=bound is None and not other_keys)
        out, lse = results
    if unbatched:
        out = out[0]
        lse = lse[0] if lse is not None else None
    return (out, lse) if return_lse else out


def _keys_fit(chosen, key, value) -> bool:
    """Whether a growing cache's keys may take the launch bound for the last ones: what
    validation checks of their length and strides (one length for key and value, at least one
    key: none takes the full path), and for a backend with 32-bit offsets, keys under 2^31
    elements (past them, the full path validates each batch and head, and NineToothed launches
    a kernel with 64-bit batch and head strides)."""
    Lk = key.shape[-2]
    if Lk == 0 or value.shape[-2] != Lk:
        return False
    return chosen.supports(OFFSETS64) or (span(key) < OFFSET_LIMIT and span(value) < OFFSET_LIMIT)


def _needs_grad(call) -> bool:
    return torch.is_grad_enabled() and (
        call.query.requires_grad or call.key.requires_grad or call.value.requires_grad
        or (call.sinks is not None and call.sinks.requires_grad))

