"""The kernel backends as torch operators: what autograd and torch.compile see.

Each kernel backend gets two operators in the ``twin_attention`` namespace,
``<backend>_forward`` and ``<backend>_backward``, defined with the
``torch.library.Library`` API: an implementation and a fake one (shapes only,
for tracing), no autograd kernel. An ``autograd.Function`` per backend
(:data:`FUNCTIONS`) calls the forward operator and differentiates it with the
backward one. ``torch.compile`` sees each operator as one opaque node (it never
traces into our Triton code), autograd sees one differentiable function.

:func:`forward` and :func:`backward` are the operators' bodies: plan, launch,
return (a layout met before: its kept plan or bound launches, ``common.reuse``).
:mod:`common.dispatch` calls :func:`forward` directly where neither
autograd nor a compiler is watching (no input needs a gradient, not compiling),
and a plain call's layout seen before runs its kept plan (``common.reuse``):
either spares the operator dispatch on every call of a user's inference loop.
"""

import contextlib

import torch

from common import plan as planning
from common.backends import BACKENDS, get_backend
from common.validation import FP8_DTYPES, Call, output_dtype

NAMESPACE = "twin_attention"


def forward(backend, call: Call, with_lse: bool):
    """``(out, lse)`` for a validated 4-D call; lse None unless ``with_lse``. A plain call of a layout met
    before runs the plan kept for it (``common.reuse.kept_forward``: no planning, a bound launch)."""
    q, v = call.query, call.value
    B, H, Lq, _ = q.shape
    Lk, Dv = call.key.shape[2], v.shape[3]
    if B * H * Lq == 0 or Lk == 0:
        # Nothing to launch. With no keys at all SDPA returns zeros, and the log-sum-exp is
        # that of an empty set (-inf) or, with sinks, of each head's sink logit alone, as in
        # any row that sees no key (the sink has no value: the output stays 0).
        out = q.new_zeros((B, H, Lq, Dv), dtype=call.output_dtype)
        lse = None
        if with_lse:
            lse = q.new_full((B, H, Lq), float("-inf"), dtype=torch.float32)
            if call.sinks is not None:
                lse.copy_(call.sinks.float()[None, :, None].expand(B, H, Lq))
        return out, lse
    from common.reuse import kept_forward  # (common.reuse imports this module)

    results = kept_forward(backend, call, with_lse)
    if results is not None:
        return results
    with _on_device(q.device):
        plan = planning.make_forward(call, backend, with_lse=with_lse)
        with _quiet(backend):
            return plan.results(*backend.load().forward(plan))


def forward_resume(backend, call: Call, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a validated 4-D call's keys into a running result over other keys, in place:
    ``out`` (B, H, Lq, Dv) float32 and ``lse`` (B, H, Lq) float32 (any strides) become
    the output and log-sum-exp over both key sets, as merging two partial results by
    their log-sum-exps would give them; a row whose lse is -inf has seen no key yet.
    One launch, no merge pass (context parallelism's ring). Kernel backends; no dropout,
    sinks or packed sequences (a ring has none)."""
    B, H, Lq, _ = call.query.shape
    if B * H * Lq == 0 or call.key.shape[2] == 0:
        return
    with _on_device(call.query.device):
        plan = planning.make_forward(call, backend, with_lse=True, resume=(out, lse))
        with _quiet(backend):
            backend.load().forward(plan)


def backward(backend, call: Call, out, lse, grad_out, grad_lse=None):
    """``(dq, dk, dv)`` for a validated 4-D call, its output and log-sum-exp. A call of a layout met
    before runs the launches kept for it (``common.reuse.KeptBackward``: no planning, bound launches)."""
    q, k, v = call.query, call.key, call.value
    B, H, Lq, _ = q.shape
    if B * H * Lq == 0 or k.shape[2] == 0:
        # No rows, or no keys: every gradient is zero.
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    from common.reuse import BACKWARDS, KeptBackward, backward_layout  # (common.reuse imports this module)

    layout = backward_layout(backend, call, out, lse, grad_out, grad_lse)
    if layout is not None:
        kept = BACKWARDS.get(layout)
        if kept is None:
            BACKWARDS.put(layout, kept := KeptBackward())
        grads = kept.run(backend, call, out, lse, grad_out, grad_lse)
        if grads is not None:
            return grads
    with _on_device(q.device):
        plan = planning.make_backward(call, backend, out, lse, grad_out, grad_lse)
        with _quiet(backend):
            return backend.load().backward(plan)


def _on_device(device):
    """Make the tensors' GPU the current one while planning and launching: Triton
    launches on the current device and its current stream, which need not be
    theirs (a model spread over GPUs calls a layer on cuda:1 with cuda:0 current)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _quiet(backend):
    """Under Triton's interpreter the kernels run as NumPy code, which warns where
    a GPU computes quietly: the log of an empty row's zero sum (-inf, the
    intended value), and arithmetic on the rows and keys past the end of a tile
    (cast to half precision, multiplied in a dot product) that the masked
    stores then leave out. Silence those; the tests check every stored value."""
    if backend.kernels and backend.interpreted():
        import numpy

        return numpy.errstate(divide="ignore", over="ignore", invalid="ignore")
    return contextlib.nullcontext()


def _call(query, key, value, attn_mask, is_causal, scale, dropout_p, dropout_seed, band_spec, softcap,
          sinks=None, row_bands=None, alibi_slopes=None, alibi_shifts=None, descales=None, out_dtype=None,
          deterministic=False):
    left, right, bottom_right = band_spec
    window = None if left == right == -1 else (left, right)
    return Call(query, key, value, attn_mask, is_causal, scale, return_lse=True, unbatched=False,
                dropout_p=dropout_p, dropout_seed=dropout_seed, window=window, bottom_right=bool(bottom_right),
                softcap=softcap if softcap > 0.0 else None, sinks=sinks, row_bands=row_bands,
                alibi_slopes=alibi_slopes, alibi_shifts=alibi_shifts,
                descales=descales if key.dtype in FP8_DTYPES else None, out_dtype=out_dtype,
                deterministic=deterministic)



def extras(call: Call) -> tuple[list[int], float]:
    """A call's window, alignment and soft-capping as the operators take them:
    ([left, right, bottom_right], softcap or 0.0)."""
    left, right = call.window if call.window is not None else (-1, -1)
    return [left, right, int(call.bottom_right)], call.softcap or 0.0


def sinks_grad(sinks, out, lse, grad_out, grad_lse=None) -> torch.Tensor:
    """d loss / d sinks, (H,): a sink's probability in row i is p = exp(sink - lse_i) (the
    lse includes the sink) and d out_i / d sink = -p out_i, so the gradient is
    -sum over batch and rows of p * delta_i, delta_i = rowsum(dO_i * O_i) - dlse_i (a
    gradient of the lse adds p * dlse_i). The backward kernels need nothing else of the sinks."""
    delta = (grad_out.float() * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse
    p = torch.exp(sinks.float()[None, :, None] - lse)
    return -(p * delta).sum((0, 2)).to(sinks.dtype)


def new_seed(device) -> torch.Tensor:
    """A dropout seed drawn from ``device``'s default generator (``torch.manual_seed``
    makes it reproducible): int64, one element, on ``device`` (no host sync)."""
    return torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, device=device)  # (torch.compile traces randint)


_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
_FORWARD_SCHEMA = ("(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, bool is_causal, float scale, "
                   "float dropout_p, Tensor? dropout_seed, int[] band_spec, float softcap, Tensor? sinks, "
                   "Tensor? row_bands=None, Tensor? alibi_slopes=None, Tensor? alibi_shifts=None, "
                   "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, "
                   "ScalarType? out_dtype=None) -> (Tensor, Tensor)")
_BACKWARD_SCHEMA = ("(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, Tensor out, "
                    "Tensor lse, Tensor? grad_lse, bool is_causal, float scale, float dropout_p, "
                    "Tensor? dropout_seed, int[] band_spec, float softcap, Tensor? row_bands=None, "
                    "Tensor? alibi_slopes=None, Tensor? alibi_shifts=None, bool deterministic=False) "
                    "-> (Tensor, Tensor, Tensor)")


def _register(name: str):
    """Define ``<name>_forward`` and ``<name>_backward`` for the kernel backend ``name``,
    and the ``autograd.Function`` that differentiates the first with the second.

    The operators are defined with the Library API and carry no autograd kernel of
    their own: ``custom_op`` + ``register_autograd`` put a Python autograd kernel
    in front of every call, several times this way's host time (benchmarks/NOTES.md,
    "Dropout and the operators' host cost"). Autograd goes through :class:`torch.autograd.Function` instead, which
    ``torch.compile`` traces (forward and backward) like the operators.
    """
    backend = get_backend(name)

    def forward_impl(query, key, value, attn_mask, is_causal, scale, dropout_p, dropout_seed, band_spec, softcap,
                     sinks, row_bands=None, alibi_slopes=None, alibi_shifts=None, q_descale=None, k_descale=None,
                     v_descale=None, out_dtype=None):
        call = _call(query, key, value, attn_mask, is_causal, scale, dropout_p, dropout_seed, band_spec, softcap,
                     sinks, row_bands, alibi_slopes, alibi_shifts, (q_descale, k_descale, v_descale),
                     output_dtype(query.dtype, out_dtype))
        return forward(backend, call, with_lse=True)

    def forward_fake(query, key, value, attn_mask, is_causal, scale, dropout_p, dropout_seed, band_spec, softcap,
                     sinks, row_bands=None, alibi_slopes=None, alibi_shifts=None, q_descale=None, k_descale=None,
                     v_descale=None, out_dtype=None):
        B, H, Lq, _ = query.shape
        return (query.new_empty((B, H, Lq, value.shape[3]), dtype=output_dtype(query.dtype, out_dtype)),
                query.new_empty((B, H, Lq), dtype=torch.float32))

    def backward_impl(grad_out, query, key, value, attn_mask, out, lse, grad_lse, is_causal, scale, dropout_p,
                      dropout_seed, band_spec, softcap, row_bands=None, alibi_slopes=None, alibi_shifts=None,
                      deterministic=False):
        call = _call(query, key, value, attn_mask, is_causal, scale, dropout_p, dropout_seed, band_spec, softcap,
                     row_bands=row_bands, alibi_slopes=alibi_slopes, alibi_shifts=alibi_shifts,
                     deterministic=deterministic)
        return backward(backend, call, out, lse, grad_out, grad_lse)

    def backward_fake(grad_out, query, key, value, attn_mask, out, lse, grad_lse, is_causal, scale, dropout_p,
                      dropout_seed, band_spec, softcap, row_bands=None, alibi_slopes=None, alibi_shifts=None,
                      deterministic=False):
        return (torch.empty_like(query, memory_format=torch.contiguous_format),
                torch.empty_like(key, memory_format=torch.contiguous_format),
                torch.empty_like(value, memory_format=torch.contiguous_format))

    for op, schema, impl, fake in ((f"{name}_forward", _FORWARD_SCHEMA, forward_impl, forward_fake),
                                   (f"{name}_backward", _BACKWARD_SCHEMA, backward_impl, backward_fake)):
        _LIBRARY.define(op + schema)
        _LIBRARY.impl(op, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{op}", fake, lib=_LIBRARY)
    forward_op = getattr(torch.ops.twin_attention, f"{name}_forward").default
    backward_op = getattr(torch.ops.twin_attention, f"{name}_backward").default

    class Attention(torch.autograd.Function):
        """query, key, value -> (out, lse), differentiable in query, key and value."""

        @staticmethod
        def forward(ctx, query, key, value, attn_mask, is_causal, scale, dropout_p, dropout_seed, band_spec, softcap,
                    sinks, row_bands=None, alibi_slopes=None, alibi_shifts=None, deterministic=False):
            out, lse = forward_op(query, key, value, attn_mask, is_causal, scale, dropout_p, dropout_seed, band_spec,
                                  softcap, sinks, row_bands, alibi_slopes, alibi_shifts)
            ctx.save_for_backward(query, key, value, attn_mask, out, lse, dropout_seed, sinks, row_bands, alibi_slopes,
                                  alibi_shifts)
            ctx.is_causal, ctx.scale, ctx.dropout_p = is_causal, scale, dropout_p
            ctx.band_spec, ctx.softcap, ctx.deterministic = band_spec, softcap, deterministic
            # An output that takes no part in the loss gets None, not zeros: most
            # calls use the output alone, and a zero gradient of the lse would
            # still cost a read in the kernel.
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True
                raise RuntimeError(
                    f"gradients of gradients (double backward) through attention are not supported by the "
                    f"{name!r} backend; use backend='torch' for them"
                )
            (query, key, value, attn_mask, out, lse, dropout_seed, sinks, row_bands, alibi_slopes,
             alibi_shifts) = ctx.saved_tensors
            if grad_out is None:  # only the lse takes part
                grad_out = torch.zeros_like(out)
            dq, dk, dv = backward_op(grad_out, query, key, value, attn_mask, out, lse, grad_lse,
                                     ctx.is_causal, ctx.scale, ctx.dropout_p, dropout_seed, ctx.band_spec,
                                     ctx.softcap, row_bands, alibi_slopes, alibi_shifts, ctx.deterministic)
            dsinks = sinks_grad(sinks, out, lse, grad_out, grad_lse) if ctx.needs_input_grad[10] else None
            # (the slopes get no gradient)
            return dq, dk, dv, None, None, None, None, None, None, None, dsinks, None, None, None, None

    return forward_op, backward_op, Attention


_REGISTERED = {name: _register(name) for name, b in BACKENDS.items() if b.kernels}
OPS = {name: registered[:2] for name, registered in _REGISTERED.items()}  # (forward, backward) operators
FUNCTIONS = {name: registered[2] for name, registered in _REGISTERED.items()}  # their autograd.Functions
