"""The Triton backend: launching ``impl_triton.kernels`` and ``impl_triton.paged_kernels`` for a
plan (``common.plan``, ``common.paged``), and the forward's launch bound to a layout for reuse.

The backend module ``common.backends`` registers: ``forward``, ``backward``, ``refine_forward``,
``refine_paged``, ``bind_forward``, ``paged_forward``, ``append_kv``, ``rotary``, ``copy_values``.
Kernels are launched through ``common.launch.CachedLauncher`` (compiled kernels without Triton's
per-call dispatch).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton

from common.interpret import apply_interpreter_fixes
from common.launch import (
    BoundKernel,
    BoundSequence,
    BoundSlots,
    CachedLauncher,
    alignment,
    int_classes,
    ticket_counters,
)
from common.paged import cache_widen, column_pages
from common.plan import ForwardPlan
from common.validation import in_wide_storage
from impl_triton import gluon_attention, gluon_backward
from impl_triton.kernels import _attn_bwd_dkdv, _attn_bwd_dq, _attn_fwd, _copy_values, _merge_kernel
from impl_triton.paged_kernels import _append_kv, _paged_fwd, _rotary

# -- the backend's own decisions: its refinement of a plan --------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Refinement:
    """What this backend decides for a plan besides the shared plan (``plan.refinement``)."""

    kernel_merge: bool  # split: the kernel merges its own splits (else a _merge_kernel launch does)


_REFINEMENTS = {merges: Refinement(merges) for merges in (False, True)}  # (the two values, made once)


def kernel_merges(planner, num_splits: int, block_m: int, kv_bytes: int) -> bool:
    """Whether the kernel merges its own ``num_splits`` splits of ``block_m``-row blocks reading
    ``kv_bytes`` of keys and values (the last program of each row block to finish folds them in,
    one launch a call), or a merge launch does. The kernel does while splits x BLOCK_M is at most
    ``planner.kernel_merge_max`` (past it that one program's fold outlasts the rest of the launch),
    or while the bytes are under ``planner.kernel_merge_min_bytes`` (a launch too short to hide a
    second launch's host time): benchmarks/NOTES.md, "Decode at B = 1, Lk = 64k"."""
    return num_splits > 1 and (num_splits * block_m <= planner.kernel_merge_max
                               or kv_bytes < planner.kernel_merge_min_bytes)


def refine_forward(plan, kv_bytes: int) -> None:
    """``plan.refinement`` of a ``common.plan.ForwardPlan`` (``common.backends.KernelBackendModule``)."""
    plan.refinement = _REFINEMENTS[kernel_merges(plan.planner, plan.num_splits, plan.config.block_m, kv_bytes)]


def refine_paged(plan, kv_bytes: int) -> None:
    """``plan.refinement`` of a ``common.paged.PagedPlan``: the same rule, on the bytes its table can address."""
    plan.refinement = _REFINEMENTS[kernel_merges(plan.planner, plan.num_splits, plan.config.block_m, kv_bytes)]


# -- launching a plan ---------------------------------------------------------------------

def _interpreted() -> bool:
    return not isinstance(_attn_fwd, triton.runtime.JITFunction)


INTERPRETED = _interpreted()
if INTERPRETED:
    apply_interpreter_fixes()

# compiled kernels, launched without Triton's per-call dispatch
_fwd_launcher = CachedLauncher(_attn_fwd)
_dq_launcher = CachedLauncher(_attn_bwd_dq)
_dkdv_launcher = CachedLauncher(_attn_bwd_dkdv)
_merge_launcher = CachedLauncher(_merge_kernel)
_paged_launcher = CachedLauncher(_paged_fwd)
_append_launcher = CachedLauncher(_append_kv)
_rotary_launcher = CachedLauncher(_rotary)
_copy_launcher = CachedLauncher(_copy_values)


def _band_args(plan) -> tuple[int, int, float]:
    """(band_lo, band_hi, softcap): what BANDED and SOFTCAP kernels read; unread (0, 0) and 0.0 otherwise."""
    return (*(plan.band if plan.band is not None else (0, 0)), plan.softcap)


def _alibi_args(plan, unread) -> tuple:
    """((SLOPES, SHIFTS), (stride_az, stride_ah, stride_am, stride_as)): the ALIBI kernels' per-row
    slopes (B, H, Lq) and position shifts (Lq,); ``unread`` where there are none."""
    if plan.alibi is None:
        return (unread, unread), (0, 0, 0, 0)
    return (plan.alibi, plan.alibi_shift), (*plan.alibi.stride(), *plan.alibi_shift.stride())


def _row_band_args(plan, unread) -> tuple:
    """(ROW_LO, ROW_HI, KEY_LO, KEY_HI): the ROW_BANDS kernels' per-row and per-key
    offsets (views of ``plan.row_bands``); ``unread`` where there are none."""
    if plan.row_bands is None:
        return unread, unread, unread, unread
    Lq = plan.query.shape[2]
    bands = plan.row_bands
    return bands[0, :Lq], bands[1, :Lq], bands[0, Lq:], bands[1, Lq:]


def forward(plan):
    """Launch the forward (and, for split keys, the merge) for a ``common.plan.ForwardPlan``.

    Returns ``(plan.out, plan.lse)``, filled in.
    """
    chosen = gluon_attention.variant(plan)  # (sm_90: the Gluon kernel where the config table says)
    if chosen is not None:
        return gluon_attention.forward_plan(plan, chosen)
    _fwd_launcher.run(*_forward_launch(plan)[:5])
    if plan.split and not plan.refinement.kernel_merge:
        _merge_launcher.run(*_merge_launch(plan, plan.value.shape[3], plan.lse))
    return plan.out, plan.lse


def _merge_launch(plan, head_dim_v: int, lse) -> tuple:
    """(grid, args, num_warps, num_stages): the launch of :func:`_merge_kernel` for a split
    plan (dense or paged) whose kernel does not merge its own splits; ``lse``: the merged
    log-sum-exp to write, or None."""
    merge = plan.merge
    # (the plan's steps of Planner.merge_splits splits whatever their number, and rows per
    # program for that tile, at most Planner.merge_tile elements, so that no split count of a
    # growing cache compiles a kernel of its own and no tile spills)
    args = _merge_launcher.positional((
        plan.o_part, plan.lse_part, plan.out, lse if lse is not None else plan.out, merge.rows, plan.num_splits,
    ), dict(HEAD_DIM_V=head_dim_v, BLOCK_R=merge.block_r, BLOCK_S=merge.block_s, BLOCK_DV=plan.block_dv,
            WITH_LSE=lse is not None))
    return (-(-merge.rows // merge.block_r), 1, 1), args, 4, 1


def _forward_launch(plan) -> tuple:
    """(grid, args, num_warps, num_stages, maxnreg, counts): the forward launch of a plan, every
    argument positional (``CachedLauncher.run``); counts, the split's ticket counters (None unsplit)."""
    q, k, v, out = plan.query, plan.key, plan.value, plan.out
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    config = plan.config
    if plan.attn_mask is None:
        mask, mask_strides = out, (0, 0, 0, 0)  # never read: MASK_KIND is NO_MASK
    else:
        mask, mask_strides = plan.attn_mask, plan.attn_mask.stride()
    if plan.split:
        o, lse, o_strides = plan.o_part, plan.lse_part, plan.o_part.stride()
        lse_strides = lse.stride()
    else:
        o, o_strides = out, (*out.stride()[:3], 0, out.stride(3))
        lse = plan.lse if plan.lse is not None else out  # never written without WITH_LSE
        lse_strides = (*plan.lse.stride(), 0) if plan.lse is not None else (0, 0, 0, 0)
    seed = plan.seed if plan.seed is not None else out  # never read without DROPOUT
    sinks, sink_strides = (plan.sinks, plan.sinks.stride()) if plan.sinks is not None else (out, (0, 0, 0))
    row_lo, row_hi, _, _ = _row_band_args(plan, out)
    alibi_tensors, slope_strides = _alibi_args(plan, out)
    # Split keys: the kernel merges them itself (the last program of each row block to finish),
    # or a launch of its own does (_merge_launch; the plan's Refinement, kernel_merges). Either way
    # the kernel is compiled with the ticket's code (kernel_merge is an argument): int32 counters.
    kernel_merge = plan.refinement.kernel_merge
    counts = ticket_counters(q.device, plan.m_blocks * B * H if kernel_merge else 1) if plan.split else None
    merged_lse = plan.lse if plan.lse is not None else out  # never written without with_lse
    descales = plan.descales if plan.descales is not None else (out, out, out)  # never read without DESCALE
    descale_strides = ([s for d in plan.descales for s in (*d.stride(), 0)[:3]] if plan.descales is not None
                       else (0,) * 9)  # (batch, head, row): 0 for the row of a per-head descale
    args = _fwd_launcher.positional((
        q, k, v, o, lse, mask, seed, sinks, *alibi_tensors, row_lo, row_hi, out, merged_lse,
        counts if counts is not None else out, *descales,
        *q.stride(), *k.stride(), *v.stride(), *o_strides, *mask_strides, *sink_strides, *slope_strides, *lse_strides,
        *descale_strides, H, plan.group, Lq, Lk, plan.scale, plan.m_blocks, plan.num_splits, plan.blocks_per_split,
        plan.dropout_p, plan.dropout_scale, *_band_args(plan), int(kernel_merge),
    ), dict(
        HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=plan.block_d, BLOCK_DV=plan.block_dv, BANDED=plan.banded, MASK_KIND=int(plan.mask_kind),
        WITH_LSE=plan.kernel_lse, NEGATIVE_SCALE=plan.negative_scale, DOT_PRECISION=plan.dot_precision,
        SPLIT=plan.split, DROPOUT=plan.dropout, SOFTCAP=int(plan.softcap_kind), SINKS=plan.sinks is not None,
        RESUME=plan.resume, MERGE_LSE=plan.with_lse, ALIBI=plan.alibi is not None,
        DESCALE=plan.descale_kind, WIDEN_K=int(plan.widen_k), WIDEN_V=int(plan.widen_v),
    ))
    grid = (plan.m_blocks * B * H, plan.num_splits, 1)
    return grid, args, config.num_warps, config.num_stages, config.maxnreg, counts


def bind_forward(plan, keys: bool = False):
    """The launch of ``plan`` bound to its layout, for later calls laid out alike (a
    ``common.reuse.AttentionPlan``'s): a :class:`BoundForward`, or None where the launch's
    tensors are not all the plan's own or its call's mask (dropout, sinks, ALiBi's slopes, packed
    sequences, a running result: those calls are not templated either). ``keys``: later calls may differ in the
    keys' length and strides (a growing cache; same config and split count): those arguments
    come from each call's plan (:meth:`BoundForward.launch_plan`). A plan the Gluon kernel runs
    (sm_90) binds a :class:`gluon_attention.BoundGluon` (not for growing keys: those calls go through
    :func:`forward`), the tl kernel's launch beside it for inputs TMA cannot read."""
    chosen = gluon_attention.variant(plan)
    if chosen is None:
        return _bind_tl(plan, keys)
    fallback = None if keys else _bind_tl(plan, keys)
    return gluon_attention.BoundGluon(plan, chosen, fallback) if fallback is not None else None


def _bind_tl(plan, keys: bool):
    """``bind_forward``'s launch of the tl kernel."""
    grid, args, num_warps, num_stages, maxnreg, counts = _forward_launch(plan)
    prefix = _tensor_roles(plan, args, counts)
    if prefix is None:
        return None
    tail = args[len(prefix):]
    counters = plan.m_blocks * plan.query.shape[0] * plan.query.shape[1] if counts is not None else 0
    merge = None
    if plan.split and not plan.refinement.kernel_merge:  # its tensors: the partials and outputs, by position
        merge_grid, merge_args, merge_warps, merge_stages = _merge_launch(plan, plan.value.shape[3], plan.lse)
        merge = BoundMerge(merge_args[4:], merge_grid, merge_warps, merge_stages, plan.lse is not None)
    return BoundForward(tuple(BoundForward.ROLES.index(r) for r in prefix), tail, grid, num_warps, num_stages,
                        maxnreg, counters, _KEY_ARGS if keys else (), merge)


def _tensor_roles(plan, args, counts):
    """The role (``BoundForward.ROLES``) of each of a forward launch's leading tensor arguments,
    or None where one of its tensors is not the plan's own or its call's mask (a seed, sinks, bands)."""
    if args[0] is not plan.query or args[1] is not plan.key or args[2] is not plan.value:
        return None
    # Q, K and V by position (a call may pass one tensor as two of them: attention(x, x, x)), and
    # so FP8 descales (one tensor may be two of them); the other tensors by identity: the plan's
    # fresh outputs, or the counters.
    roles = {id(t): role for role, t in zip(("out", "lse", "o_part", "lse_part", "counts", "attn_mask"), (
        plan.out, plan.lse, plan.o_part, plan.lse_part, counts, plan.attn_mask)) if t is not None}
    by_position = {0: "query", 1: "key", 2: "value"}
    if plan.descales is not None:
        by_position.update({_DESCALE_ARGS[0]: "q_descale", _DESCALE_ARGS[1]: "k_descale",
                            _DESCALE_ARGS[2]: "v_descale"})
    prefix = ["query", "key", "value"]
    for position, arg in enumerate(args[3:], 3):
        if not isinstance(arg, torch.Tensor):
            break
        role = by_position.get(position) or roles.get(id(arg))
        if role is None:
            return None
        prefix.append(role)
    if any(isinstance(arg, torch.Tensor) for arg in args[len(prefix):]):
        return None
    return prefix


# the forward's FP8 descales' positions (roles by position, _tensor_roles)
_DESCALE_ARGS = tuple(_fwd_launcher.arg_index(name) for name in ("Q_DESCALE", "K_DESCALE", "V_DESCALE"))
# the forward's arguments that depend on the keys' length and strides (BoundForward's holes)
_KEY_ARGS = tuple(_fwd_launcher.arg_index(name) for name in (
    "stride_kz", "stride_kh", "stride_kn", "stride_kd", "stride_vz", "stride_vh", "stride_vn", "stride_vd",
    "Lk", "BLOCKS_PER_SPLIT"))


class BoundForward(BoundKernel):
    """A forward launch whose scalar arguments are fixed by its layout: a later call of that
    layout supplies its tensors (``common.reuse.BoundLaunch``) and, for ``holes``, the
    arguments that depend on its keys (:meth:`launch_plan`), and launches without building
    the ~60 arguments or our launch cache's key again (``common.launch.BoundKernel``: the
    compiled kernel per alignment of the inputs and class of each hole's integer)."""

    ROLES = (*ForwardPlan.ROLES, "counts")

    def __init__(self, prefix, tail, grid, num_warps, num_stages, maxnreg, counters, holes=(), merge=None):
        super().__init__(_fwd_launcher, grid, num_warps, num_stages, maxnreg)
        self.prefix, self.tail = prefix, tail
        self.counters = counters  # ticket counters a split launch that merges itself takes (else 0)
        self.holes = tuple(i - len(prefix) for i in holes)  # positions in the tail
        self.merge = merge  # a split whose merge is a launch of its own: that launch (BoundMerge)

    def __call__(self, tensors, values=()) -> None:
        """Launch on ``tensors`` (one per role but the counters, in ROLES order; None where the
        call has none) and ``values`` (one per hole)."""
        if self.counters:
            tensors = (*tensors, ticket_counters(tensors[3].device, self.counters))
        tail = self.tail
        if values:
            tail = list(tail)
            for i, value in zip(self.holes, values):
                tail[i] = value
            tail = tuple(tail)
        # (each tensor's address once. The compiled kernel is kept per alignment of the caller's tensors, the
        # query, keys, values, FP8 descales and mask: the others come from the allocator, aligned.)
        pointers = [t.data_ptr() if t is not None else 0 for t in tensors]
        aligned = alignment(pointers[:3] + pointers[7:11])
        key = (aligned, int_classes(values)) if values else aligned
        kernel = self.kernels.get(key)
        if kernel is not None:  # (addresses: common.launch.BoundKernel.run_compiled)
            self.run_compiled(kernel, (*[pointers[i] for i in self.prefix], *tail))
        else:
            self.launch_new(tuple([tensors[i] for i in self.prefix]) + tail, key)
        if self.merge is not None:
            self.merge(tensors)

    def launch_keys(self, tensors, blocks_per_split: int) -> None:
        """Launch for keys of another length and strides (bound with ``keys``)."""
        key, value = tensors[1], tensors[2]
        self(tensors, (*key.stride(), *value.stride(), key.shape[2], blocks_per_split))

    def launch_plan(self, plan) -> None:
        """Launch a plan of the bound layout whose keys may differ in length and strides."""
        self.launch_keys(plan.tensors(), plan.blocks_per_split)


class BoundMerge(BoundKernel):
    """:func:`_merge_kernel`'s launch bound to a split layout: every argument but the partials
    and outputs, which a :class:`BoundForward` passes (all from the allocator: aligned)."""

    def __init__(self, tail, grid, num_warps, num_stages, with_lse: bool):
        super().__init__(_merge_launcher, grid, num_warps, num_stages)
        self.tail, self.with_lse = tail, with_lse

    def __call__(self, tensors) -> None:
        """Launch on a BoundForward's ``tensors`` (ROLES order: out, lse, o_part, lse_part at 3-6)."""
        lse = tensors[4] if self.with_lse else tensors[3]  # never written without WITH_LSE
        kernel = self.kernels.get(True)
        if kernel is not None:  # addresses (BoundForward.__call__)
            self.run_compiled(kernel, (tensors[5].data_ptr(), tensors[6].data_ptr(), tensors[3].data_ptr(),
                                       lse.data_ptr(), *self.tail))
        else:
            self.launch_new((tensors[5], tensors[6], tensors[3], lse) + self.tail, True)


def backward(plan):
    """Launch the backward for a ``common.plan.BackwardPlan``: the dQ pass (which
    also stores delta), then the dK/dV pass; on sm_90, where ``gluon_backward.one_pass``
    says, the Gluon one pass instead (not bitwise reproducible: never for a plan that asks
    for a deterministic backward). Returns ``(dq, dk, dv)``, filled in."""
    if gluon_backward.one_pass(plan):
        return gluon_backward.backward_plan(plan)
    for launcher, grid, args, num_warps, num_stages, _ in _backward_launches(plan):
        launcher.run(grid, args, num_warps, num_stages)
    return plan.grad_query, plan.grad_key, plan.grad_value


def _backward_launches(plan) -> tuple:
    """((launcher, grid, args, num_warps, num_stages, roles) of the dQ pass, the same of the dK/dV
    pass), every argument positional (``CachedLauncher.run``); ``roles``, for :func:`bind_backward`:
    which of the plan's tensors (index into ``BackwardPlan.ROLES``) each leading tensor argument is,
    by position (one tensor may be passed as two of them)."""
    q, k, v = plan.query, plan.key, plan.value
    B, H, Lq, D = q.shape
    H_kv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    config = plan.config
    if plan.attn_mask is None:
        mask, mask_strides = q, (0, 0, 0, 0)  # never read: MASK_KIND is NO_MASK
    else:
        mask, mask_strides = plan.attn_mask, plan.attn_mask.stride()
    dlse = plan.grad_lse
    dlse_strides = dlse.stride() if dlse is not None else (0, 0, 0)
    seed = plan.seed if plan.seed is not None else q  # never read without DROPOUT
    row_lo, row_hi, key_lo, key_hi = _row_band_args(plan, q)
    alibi_tensors, slope_strides = _alibi_args(plan, q)
    common = dict(
        HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=plan.block_d, BLOCK_DV=plan.block_dv,
        BANDED=plan.banded, MASK_KIND=int(plan.mask_kind), DOT_PRECISION=plan.dot_precision,
        DROPOUT=plan.dropout, SOFTCAP=int(plan.softcap_kind), ALIBI=plan.alibi is not None,
    )
    m_blocks, n_blocks = -(-Lq // config.block_m2), -(-Lk // config.block_n1)
    dq = _dq_launcher.positional((
        q, k, v, plan.out, plan.grad_out, plan.lse, dlse if dlse is not None else plan.lse, plan.delta,
        plan.grad_query, mask, seed, *alibi_tensors, row_lo, row_hi,
        *q.stride(), *k.stride(), *v.stride(), *plan.out.stride(), *plan.grad_out.stride(), *plan.lse.stride(),
        *dlse_strides, *mask_strides, *slope_strides,
        H, plan.group, Lq, Lk, plan.scale, m_blocks, plan.dropout_p, plan.dropout_scale, *_band_args(plan),
    ), dict(BLOCK_M=config.block_m2, BLOCK_N=config.block_n2, WITH_DLSE=dlse is not None, **common))
    dkdv = _dkdv_launcher.positional((
        q, k, v, plan.grad_out, plan.lse, plan.delta, plan.grad_key, plan.grad_value, mask, seed, *alibi_tensors,
        row_lo, row_hi, key_lo, key_hi,
        *q.stride(), *k.stride(), *v.stride(), *plan.grad_out.stride(), *plan.lse.stride(), *mask_strides,
        *slope_strides,
        H_kv, plan.group, Lq, Lk, plan.scale, n_blocks, plan.dropout_p, plan.dropout_scale, *_band_args(plan),
    ), dict(BLOCK_M=config.block_m1, BLOCK_N=config.block_n1, **common))
    # (query, key, value, out, grad_out, lse, the lse's gradient or the lse, delta, dq; and for dK/dV
    # query, key, value, grad_out, lse, delta, dk, dv)
    dq_roles = (0, 1, 2, 3, 4, 5, 6 if dlse is not None else 5, 7, 8)
    dkdv_roles = (0, 1, 2, 4, 5, 7, 9, 10)
    return ((_dq_launcher, (m_blocks * B * H, 1, 1), dq, config.num_warps, config.num_stages, dq_roles),
            (_dkdv_launcher, (n_blocks * B * H_kv, 1, 1), dkdv, config.num_warps, config.num_stages, dkdv_roles))


def bind_backward(plan):
    """The launches of ``plan`` bound to its layout, for later calls laid out alike
    (``common.reuse.KeptBackward``): a ``common.launch.BoundSequence`` of the two passes, called
    with the tensors of ``BackwardPlan.ROLES`` (a plan the Gluon one pass runs: a
    ``gluon_backward.BoundOnePass``, those two passes beside it for tensors TMA cannot take); None
    where a launch takes a tensor that is not the plan's own (a mask, dropout's seed, row bands,
    ALiBi's slopes). The plan's tensors by position
    (one tensor may be passed as two of them); the rest must be the stand-in for what a plain
    launch never reads, the query."""
    if plan.attn_mask is not None or plan.seed is not None or plan.row_bands is not None or plan.alibi is not None:
        return None
    one_pass = gluon_backward.one_pass(plan)
    bound = []
    for launcher, grid, args, num_warps, num_stages, roles in _backward_launches(plan):
        slots = list(enumerate(roles))
        for position, arg in enumerate(args[len(roles):], len(roles)):
            if isinstance(arg, torch.Tensor):
                if arg is not plan.query:
                    return None
                slots.append((position, 0))
        bound.append(BoundSlots(launcher, args, slots, grid, num_warps, num_stages))
    if one_pass:  # (the tl launches for a call whose tensors the copy engine cannot take)
        return gluon_backward.BoundOnePass(plan, BoundSequence(*bound))
    return BoundSequence(*bound)


def paged_forward(plan):
    """Launch paged attention (and, for split keys, the merge) for a ``common.paged.PagedPlan``.
    Returns ``(plan.out, plan.lse)``, filled in (``plan.lse`` None unless ``plan.with_lse``)."""
    q, out = plan.query, plan.out
    B, H, Lq, D = q.shape
    kc, vc = plan.key_cache, plan.value_cache
    Dv = vc.shape[3]
    config = plan.config
    if plan.split:
        o, lse, o_strides = plan.o_part, plan.lse_part, plan.o_part.stride()
    else:
        o, lse, o_strides = out, plan.lse if plan.with_lse else out, (*out.stride()[:3], 0, out.stride(3))
    sinks, sink_strides = (plan.sinks, plan.sinks.stride()) if plan.sinks is not None else (out, (0, 0, 0))
    slopes, slope_strides = (plan.alibi, plan.alibi.stride()) if plan.alibi is not None else (out, (0, 0, 0))
    # (as in forward(): int32 counters whenever split, taken only where the kernel merges)
    kernel_merge = plan.refinement.kernel_merge
    counts = ticket_counters(q.device, plan.m_blocks * B * H if kernel_merge else 1) if plan.split else out
    merged_lse = plan.lse if plan.split and plan.with_lse else out  # never written without MERGE_LSE
    k_descale, v_descale = plan.descales if plan.descales is not None else (out, out)
    descale_strides = (*k_descale.stride(), *v_descale.stride()) if plan.descales is not None else (0, 0, 0, 0)
    _paged_launcher(
        (plan.m_blocks * B * H, plan.num_splits, 1),
        q, kc, vc, plan.block_table, plan.cache_seqlens, plan.leftpad if plan.leftpad is not None else out,
        plan.query_lengths if plan.query_lengths is not None else out, sinks, slopes, k_descale, v_descale, o, lse,
        out, merged_lse, counts,
        *q.stride(), *kc.stride(), *vc.stride(), *plan.block_table.stride(), *sink_strides, *slope_strides,
        *descale_strides, *o_strides,
        H, plan.group, Lq, plan.lq_seq, kc.shape[0], plan.block_table.shape[1], plan.scale, plan.m_blocks,
        plan.num_splits, plan.blocks_per_split * (plan.split_block // config.block_n), *_band_args(plan),
        int(kernel_merge),
        num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.maxnreg,
        HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_M=config.block_m, BLOCK_N=config.block_n, PAGE=kc.shape[1],
        VALUE_COLUMNS=column_pages(vc), PAGE_RUN=math.gcd(kc.shape[1], config.block_n),
        BLOCK_D=plan.block_d, BLOCK_DV=plan.block_dv, BANDED=plan.band is not None,
        WITH_LSE=plan.split or plan.with_lse, DOT_PRECISION=plan.dot_precision, SPLIT=plan.split,
        SOFTCAP=int(plan.softcap_kind), SINKS=plan.sinks is not None, MERGE_LSE=plan.split and plan.with_lse,
        ALIBI=plan.alibi is not None, LEFTPADDED=plan.leftpad is not None,
        QUERY_LENGTHS=plan.query_lengths is not None, DESCALE=plan.descales is not None,
        WIDEN=int(cache_widen(plan.descales, vc)),
        WIDE_PAGES=in_wide_storage(kc, vc), PAGE_BLOCKS=page_blocks(vc, config.block_n),
    )
    if plan.split and not kernel_merge:
        _merge_launcher.run(*_merge_launch(plan, Dv, plan.lse))
    return out, plan.lse


# The largest page read as runs: from pages of 64 keys a key-by-key tile already reads whole
# 64-byte lines of FP8 values, and the runs' permute and registers cost more than they save
# (benchmarks/NOTES.md has the timings).
PAGE_BLOCKS_MAX_PAGE = 32


def page_blocks(value_cache, block_n: int) -> bool:
    """Whether ``_paged_fwd`` reads ``value_cache``'s pages as runs (its PAGE_BLOCKS): value pages
    stored column-major, each head's (Dv, PAGE) block one run of memory, and pages of 16 to
    PAGE_BLOCKS_MAX_PAGE keys (a power of two) below a step of ``block_n``, so that a step holds
    several whole pages."""
    page = value_cache.shape[1]
    return (column_pages(value_cache) and value_cache.stride(3) == page
            and 16 <= page <= min(PAGE_BLOCKS_MAX_PAGE, block_n // 2)
            and page & (page - 1) == 0 and block_n % page == 0)


def append_kv(key_cache, value_cache, block_table, cache_seqlens, key, value, *, block_m: int, block_d: int,
              block_dv: int, descales=None):
    """Write key and value (B, H_kv, L_new, D | Dv) into the paged caches, in one launch
    (``descales``: FP8 caches' (B, H_kv) key and value descales, the new tokens quantized)."""
    B, H_kv, L_new, D = key.shape
    Dv = value.shape[3]
    k_descale, v_descale = descales if descales is not None else (key, key)
    descale_strides = (*k_descale.stride(), *v_descale.stride()) if descales is not None else (0, 0, 0, 0)
    _append_launcher(
        (B * H_kv, -(-L_new // block_m), 1),
        key, value, key_cache, value_cache, block_table, cache_seqlens, k_descale, v_descale,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(), *block_table.stride(),
        *descale_strides, H_kv, L_new, key_cache.shape[0], block_table.shape[1],
        num_warps=4, num_stages=1,
        HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_M=block_m, PAGE=key_cache.shape[1],
        BLOCK_D=block_d, BLOCK_DV=block_dv, QUANTIZE=descales is not None,
    )


def rotary(x1, x2, o1, o2, cos, sin, starts, per_row: bool) -> None:
    """Rotate the pairs (x1, x2) (B, L, H, R/2 strided views) by the angles of rows
    ``starts[b]`` (+ l where ``per_row``) of cos and sin (S, R/2), into (o1, o2)."""
    B, L, H, half = x1.shape
    block_l = min(64, max(16, triton.next_power_of_2(L)))
    _rotary_launcher(
        (B * H, triton.cdiv(L, block_l), 1),
        x1, x2, o1, o2, cos, sin, starts,
        *x1.stride(), *x2.stride(), *o1.stride(), *o2.stride(), *cos.stride(), *sin.stride(),
        H, L, half, cos.shape[0],
        num_warps=4, num_stages=1,
        PER_ROW=per_row, BLOCK_L=block_l, BLOCK_R=triton.next_power_of_2(half),
    )


def copy_values(value, out, pv_order: bool = False) -> None:
    """Copy ``value`` (B, H, L, D) into ``out``, the same shape in another layout (the FP8 values
    column-major for the e4m3 P·V product: ``common.plan.Planner.fp8_columns``; ``pv_order``: each
    group of 32 keys in the P·V order, ``common.plan.pv_position``): one program per BLOCK_L rows of
    a (batch, head), every head dim at once."""
    B, H, L, D = value.shape
    block_l = 64
    _copy_launcher(
        (B * H * triton.cdiv(L, block_l), 1, 1),
        value, out, *value.stride(), *out.stride(), H, L, D,
        num_warps=4, num_stages=1, BLOCK_L=block_l, BLOCK_D=triton.next_power_of_2(D), PV_ORDER=pv_order,
    )
