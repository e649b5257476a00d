"""The NineToothed backend: making the kernels of ``impl_ninetoothed.kernels`` and
``impl_ninetoothed.paged_kernels`` (``ninetoothed.make``, once per process), launching them
for a plan (``common.plan``, ``common.paged``), and the forward's launches bound to a layout
for reuse.

The backend module ``common.backends`` registers: ``forward``, ``backward``, ``refine_forward``,
``refine_paged``, ``bind_forward``, ``paged_forward``, ``append_kv``, ``rotary``, ``copy_values``.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

import ninetoothed
import torch
import triton.language as tl

import common
import impl_ninetoothed
from common import compat
from common.codecache import generation_key, made_before, number_tensors_from_zero, remember_made, use_private_cache
from common.configs import padded_head_dim
from common.interpret import apply_interpreter_fixes, interpreter_requested
from common.jit_helpers import JIT_HELPERS
from common.launch import (
    BoundSequence,
    BoundSlots,
    define_constants,
    launcher_arguments,
    route_generated_launch,
    routed_kernel,
)
from common.paged import cache_widen, column_pages
from common.plan import DESCALE_ROWS, ForwardPlan
from common.validation import in_wide_storage
from impl_ninetoothed.kernels import (
    _COMBINE_SPLIT_COUNT_ARGS,
    _SPLIT_COUNT_ARGS,
    KERNEL_CONSTANTS,
    ONE_STAGE,
    application,
    dq_application,
    premake,
    premake_combine,
    premake_copy,
    premake_dkdv,
    premake_dq,
)
from impl_ninetoothed.paged_kernels import premake_append, premake_paged, premake_rotary

# -- making kernels: once per process, thread-safe ---------------------------------------------

_made: dict = {}
_make_lock = threading.Lock()


def _wide(*tensors) -> bool:
    """Whether a launch of these tensors (None: absent) takes 64-bit batch and head strides
    (``common.launch._rejitted``): where one of them lies in a storage of 2^31 elements or more
    (what its indexing can reach is within its storage: a bound far cheaper than
    ``common.validation.span``, on a path a decode step takes). Every other launch keeps 32-bit
    strides: made wide, every kernel ran slower (benchmarks/NOTES.md, "nt-offsets64 on the H200
    and merged"); each batch and head stays under 2^31 elements either way
    (``common.validation.slice_span``)."""
    return in_wide_storage(*tensors)


def _make(premake_fn, *args, num_warps: int, num_stages: int, maxnreg: int | None = None, wide: bool = False):
    """``ninetoothed.make(*premake_fn(*args))``, made once per process; ``maxnreg``, where not
    None, caps each thread's registers (a launch option ``make`` does not take: our launch path
    passes it, so each cap has a handle of its own); ``wide``: the kernel takes its batch and
    head strides as 64-bit integers (:func:`_wide`), a handle of its own too.

    ``make`` generates, writes and imports Triton code on every call (0.1-0.5 s)
    and sets the application's annotations while it works, so it runs under a
    lock and its handles are kept. The code goes to a private directory,
    written atomically (``common.codecache``), where a later process finds it
    (:func:`_generate`). Each handle's generated module gets the kernels' named
    constants, and its launch goes through a ``CachedLauncher``.
    """
    key = (premake_fn, args, num_warps, num_stages, maxnreg, wide)
    handle = _made.get(key)
    if handle is not None:
        return handle
    with _make_lock:
        handle = _made.get(key)
        if handle is None:
            apply_interpreter_fixes()
            use_private_cache()
            name = "_".join(["nt_attention", premake_fn.__name__.removeprefix("premake")[1:] or "fwd",
                             *(str(a) for a in args if a is not None)])
            number_tensors_from_zero()  # the same source in every process, whatever was made before
            arrangement_, application_, tensors = premake_fn(*args)
            handle = _generate(arrangement_, application_, tensors, name, num_warps, num_stages,
                               made_as=(f"{premake_fn.__module__}.{premake_fn.__qualname__}", args))
            define_constants(handle, KERNEL_CONSTANTS)
            # NineToothed copies the module's @triton.jit helpers into the generated
            # code as written (their bodies say ``tl``), but not under the
            # interpreter (they are not JITFunctions there).
            namespace = compat.generated_namespace(handle)
            namespace.setdefault("tl", tl)
            for helper in JIT_HELPERS:
                namespace.setdefault(helper.__name__, helper)
            split_counts = (_SPLIT_COUNT_ARGS if premake_fn is premake and args[4]
                            else _COMBINE_SPLIT_COUNT_ARGS if premake_fn is premake_combine else ())
            loose = _loose_arguments(handle, application_, split_counts)
            handle = _made[key] = route_generated_launch(handle, loose, maxnreg, wide_strides=wide)
    return handle


def _generate(arrangement_, application_, tensors, name: str, num_warps: int, num_stages: int, made_as: tuple):
    """``ninetoothed.make(arrangement_, application_, tensors, ...)``, or the handle of the module
    an earlier process made of the same (``made_as``: the premake's name and arguments) from the
    same sources, on the same kind of device (``common.codecache.generation_key``), imported
    as ``make`` imports it. (The helpers' type is part of the key: NineToothed copies into the code
    the ones that are ``JITFunction``s, which under the interpreter they are not.)"""
    key = generation_key((common, impl_ninetoothed, ninetoothed), made_as, name, num_warps, num_stages,
                         type(JIT_HELPERS[0]).__name__, sorted(compat.generator_device_properties().items()))
    path = made_before(key)
    handle = compat.handle_of_generated(path, name) if path is not None else None
    if handle is None:
        handle = ninetoothed.make(arrangement_, application_, tensors, kernel_name=name, num_warps=num_warps,
                                  num_stages=num_stages)
        remember_made(key, compat.generated_source_file(handle))
    return handle


def _loose_arguments(handle, application_, split_counts=()) -> set:
    """The arguments of ``handle``'s kernel that it is not specialised on (roles as
    ``common.launch.launcher_arguments`` describes them): ``split_counts``, in the forward every
    tensor's length (its dimension 2: each is (B, H, L, ...)) but the keys' and the values', and
    in the dQ pass the batch (the query's and the keys' dimension 0).

    NineToothed passes each tensor's sizes, so the queries' length reaches the forward eight times
    (query, bands, sinks, output, lse, the mask's rows) and the key blocks' count twice (the
    views of whole blocks), and Triton would compile a kernel for each class of each (a size of
    1, a multiple of 16, another). They bound masks and loops whose code does not depend on their class (sm_90: the
    same instructions a step). The keys' length stays, as Lk in the Triton kernel: a multiple of
    16 lets the masked steps compare keys 16 at a time and load the mask's tiles vectorised
    along it. The batch and head counts stay too: a batch of 1 is a constant the compiler
    folds (loosened, the forward spilled and ran slower). The backward passes stay specialised
    on their lengths: without it their masked steps grew. The dQ pass is not specialised on its
    batch: with its tensors' sizes shared (:func:`_like`), a batch of 1 folded into its code had
    ptxas serialise its warpgroup products (C7515); loose, no benchmark shape serialises (sm_90,
    ``tools/cpu_sass.py``). The measurements: benchmarks/NOTES.md, "Forwards not specialised on
    the queries' length" and "NineToothed's shared sizes on the H200"."""
    if application_ is dq_application:
        names = list(inspect.signature(application_).parameters)
        return {("size", names.index(name), 0) for name in ("query", "key")}
    if application_ is not application:
        return set(split_counts)
    described = launcher_arguments(compat.generated_launcher(handle)) or ()
    names = list(inspect.signature(application_).parameters)
    keys_and_values = {names.index("key"), names.index("value")}
    lengths = {role for role in described if role[0] == "size" and role[2] == 2 and role[1] not in keys_and_values}
    return lengths | set(split_counts)


INTERPRETED = interpreter_requested()


# -- the backend's own decisions: its refinement of a plan --------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Refinement:
    """What this backend decides for a forward plan besides the shared plan (``plan.refinement``)."""

    one_stage: bool  # split: each split walks its key blocks in one masked loop (the kernel's SPLIT = ONE_STAGE)


_REFINEMENTS = {one_stage: Refinement(one_stage) for one_stage in (False, True)}  # (the two values, made once)


def one_stage_split(planner, block_m: int) -> bool:
    """Whether a split launch of ``block_m``-row tiles walks its key blocks in one masked loop:
    tiles of ``planner.one_stage_split_rows`` rows and more (a warpgroup MMA's), where with the
    split size in symbols two loops had ptxas serialise the tile's MMAs; one loop costs a compare
    and a select per score in a launch bound by memory (benchmarks/NOTES.md, "Last-to-first rows
    and one-loop splits timed and merged")."""
    return block_m >= planner.one_stage_split_rows


def refine_forward(plan, kv_bytes: int) -> None:
    """``plan.refinement`` of a ``common.plan.ForwardPlan`` (``common.backends.KernelBackendModule``)."""
    plan.refinement = _REFINEMENTS[plan.split and one_stage_split(plan.planner, plan.config.block_m)]


def refine_paged(plan, kv_bytes: int) -> None:
    """``plan.refinement`` of a ``common.paged.PagedPlan``: None (the paged kernel's split has one form)."""
    plan.refinement = None


# -- launching a plan ------------------------------------------------------------------------

_scalars: dict = {}  # (device, dtype) -> one element, allocated once
_stand_ins: dict = {}  # (device, dtype, shape) -> that element broadcast to shape (a view)


def _absent(like, *shape):
    """A stand-in for a tensor a kernel never touches (a flag turns its use off): one
    element per (device, dtype), broadcast. The views are kept per shape (making one
    is a torch call, and a plain forward needs four of them); only the element holds
    memory, so starting the views over frees and allocates nothing."""
    key = (like.device, like.dtype, shape)
    stand_in = _stand_ins.get(key)
    if stand_in is None:
        scalar = _scalars.get(key[:2])
        if scalar is None:
            scalar = _scalars[key[:2]] = like.new_empty(())
        if len(_stand_ins) >= 256:
            _stand_ins.clear()
        stand_in = _stand_ins[key] = scalar.expand(*shape)
    return stand_in


def _dropout_args(plan):
    """(seed, dropout_p, dropout_scale) as the kernels take them; a stand-in seed without dropout."""
    seed = plan.seed if plan.seed is not None else _absent(plan.query, 1)
    return seed.view(1), plan.dropout_p, plan.dropout_scale


def _band_args(plan, keys=False) -> tuple:
    """(band_lo, band_hi, softcap, row_lo, row_hi[, key_lo, key_hi]): what BANDED and
    SOFTCAP kernels read (see _band_inputs); unread (0, 0), 0.0 and stand-ins otherwise."""
    B, H, Lq, _ = plan.query.shape
    H_kv, Lk = plan.key.shape[1], plan.key.shape[2]
    if plan.row_bands is None:
        per_row = (_absent(plan.query, B, H, Lq),) * 2
        per_key = (_absent(plan.query, B, H_kv, Lk),) * 2
    else:
        bands = plan.row_bands
        per_row = tuple(bands[i, :Lq].expand(B, H, Lq) for i in (0, 1))
        per_key = tuple(bands[i, Lq:].expand(B, H_kv, Lk) for i in (0, 1))
    return (*(plan.band if plan.band is not None else (0, 0)), plan.softcap, *per_row, *(per_key if keys else ()))


def _alibi_args(plan) -> tuple:
    """(slopes, alibi_shift) as ALIBI kernels read them (see _alibi_inputs): each row's slope and
    position shift as (B, H, Lq) views; stand-ins otherwise."""
    B, H, Lq = plan.query.shape[:3]
    if plan.alibi is None:
        return _absent(plan.query, B, H, Lq), _absent(plan.query, B, H, Lq)
    return plan.alibi, plan.alibi_shift.expand(B, H, Lq)


def blocked_keys(plan) -> bool:
    """Whether the forward's unmasked stage reads the keys and values through views of their
    whole blocks (:func:`_row_blocks`): every load of NineToothed's is masked against the
    bounds of its source, and a source whose block size is a constant makes the per-key
    check of those loads a constant too (fewer instructions a step of that loop on sm_90:
    benchmarks/NOTES.md, "NineToothed's unmasked loads"). Unsplit launches without dropout or
    ALiBi (whose unmasked stage reads the keys' positions from the keys' tiles)."""
    return not plan.split and not plan.dropout and plan.alibi is None


def _row_blocks(x, block: int, blocked: bool):
    """(B, H, L[, D]) -> its whole blocks of ``block`` rows, a view (B, H, L // block, block[, D])
    that starts where ``x`` does; a stand-in where the kernel reads none (not ``blocked``)."""
    B, H, L = x.shape[:3]
    if not blocked:
        return _absent(x, B, H, 1, block, *x.shape[3:])
    stride = x.stride()
    # (as_strided: one torch call, where slicing then unflattening is two)
    return x.as_strided((B, H, L // block, block, *x.shape[3:]), (*stride[:2], stride[2] * block, *stride[2:]),
                        x.storage_offset())


def _widened(plan, D: int, Dv: int) -> tuple:
    """(block_d, block_dv): each the plan's tile width where it widens the head dim past
    ``padded_head_dim``, else None (the kernel's name unchanged)."""
    return (plan.block_d if plan.block_d != padded_head_dim(D) else None,
            plan.block_dv if plan.block_dv != padded_head_dim(Dv) else None)


def _width_args(plan, D: int, Dv: int) -> tuple:
    """The trailing (block_d, block_dv) arguments of a premake whose widths come last: ``_widened``'s
    pair, or nothing where neither is widened (the kernel's name unchanged)."""
    widths = _widened(plan, D, Dv)
    return widths if widths != (None, None) else ()


def _attention_launch(plan) -> tuple:
    """(kernel, inputs, flags) of the forward's attention launch: ``kernel(*inputs, **flags)``."""
    q, out = plan.query, plan.out
    B, H, Lq, D = q.shape
    Lk, Dv = plan.key.shape[2], plan.value.shape[3]
    config = plan.config
    attn_mask = plan.attn_mask if plan.attn_mask is not None else _absent(out, B, H, Lq, Lk)
    if plan.split:
        o, lse = plan.o_part, plan.lse_part
    else:
        o, lse = out, (plan.lse if plan.lse is not None else _absent(out, B, H, Lq))
    block_d, block_dv = _widened(plan, D, Dv)
    descale_rows = True if plan.descale_kind == DESCALE_ROWS else None  # (None: the kernel's name unchanged)
    grouped = True if plan.group > 1 else None  # (one K/V head a query head: the keys take the query's sizes)
    kernel = _make(premake, D, Dv, config.block_m, config.block_n, plan.split, block_d, descale_rows, grouped,
                   *((block_dv,) if block_dv is not None else ()),
                   num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.maxnreg,
                   wide=_wide(q, plan.key, plan.value, plan.attn_mask, o, lse))
    blocked = blocked_keys(plan)
    inputs = (q, plan.key, plan.value, _row_blocks(plan.key, config.block_n, blocked),
              _row_blocks(plan.value, config.block_n, blocked), attn_mask, plan.scale, *_dropout_args(plan),
              *_band_args(plan), plan.sinks if plan.sinks is not None else _absent(out, B, H, Lq),
              *_alibi_args(plan), *_descale_args(plan), o, lse)
    return kernel, inputs, dict(
        BANDED=plan.banded, MASK_KIND=int(plan.mask_kind), WITH_LSE=plan.kernel_lse,
        NEGATIVE_SCALE=plan.negative_scale, DOT_PRECISION=plan.dot_precision, SPLIT=_split_kind(plan),
        DROPOUT=plan.dropout, SOFTCAP=int(plan.softcap_kind), SINKS=plan.sinks is not None, RESUME=plan.resume,
        BLOCKED=blocked,
        ALIBI=plan.alibi is not None, DESCALE=plan.descale_kind, WIDEN_K=int(plan.widen_k),
        WIDEN_V=int(plan.widen_v),
    )


def _descale_args(plan) -> tuple:
    """The DESCALE kernel's descales of query, key and value ((B, H_kv), or (B, H, Lq) per row);
    stand-ins without FP8 inputs."""
    if plan.descales is not None:
        return plan.descales
    stand_in = _absent(plan.out, *plan.key.shape[:2])
    return stand_in, stand_in, stand_in


def _split_kind(plan) -> int:
    """The kernel's SPLIT: 0 unsplit, 1 split, ONE_STAGE split at the derived size walked in one
    masked loop (the plan's Refinement: :func:`one_stage_split`)."""
    if not plan.split:
        return 0
    return ONE_STAGE if plan.refinement.one_stage else 1


def _merge_kernel(plan):
    merge = plan.merge
    return _make(premake_combine, plan.value.shape[3], merge.block_r, merge.block_s, num_warps=4, num_stages=1,
                 wide=_wide(plan.o_part, plan.out))


def _merge_inputs(o_part, lse_part, out, lse, rows: int, num_splits: int) -> tuple:
    """The merge's inputs: the partials (rows, splits, Dv) and (rows, splits), the output (rows,
    Dv) and its log-sum-exp (rows,), or a stand-in where none is asked for."""
    Dv = out.shape[-1]
    return (o_part.view(rows, num_splits, Dv), lse_part.view(rows, num_splits), out.view(rows, Dv),
            lse.view(rows) if lse is not None else _absent(out, rows))


def forward(plan):
    """Launch the forward (and, for split keys, the merge) for a ``common.plan.ForwardPlan``.

    Returns ``(plan.out, plan.lse)``, filled in.
    """
    kernel, inputs, flags = _attention_launch(plan)
    kernel(*inputs, **flags)
    if plan.split:
        _merge_kernel(plan)(*_merge_inputs(plan.o_part, plan.lse_part, plan.out, plan.lse, plan.merge.rows,
                                           plan.num_splits), WITH_LSE=plan.with_lse)
    return plan.out, plan.lse


def _is_stand_in(t) -> bool:
    """``t`` is one of :func:`_absent`'s stand-ins (a view of its one element)."""
    scalar = _scalars.get((t.device, t.dtype))
    return scalar is not None and t.data_ptr() == scalar.data_ptr()


def bind_forward(plan, keys: bool = False):
    """The launches of ``plan`` (just launched by :func:`forward`, on this thread) bound to its
    layout, for later calls laid out alike (a ``common.reuse.AttentionPlan``'s): a
    :class:`BoundForward` made from the arguments NineToothed's generated launchers passed to
    the kernels (recorded by ``common.launch``'s routing) and what the launchers' source says
    each one is (``common.launch.launcher_arguments``), so later calls skip the launchers and
    their reads of every size and stride. ``keys``: later calls may differ in the keys' length
    and strides (a growing cache; same config, split count and blocks per split): the keys' and
    values' sizes and strides are filled in per call. None where a launch holds a tensor that
    is neither the plan's own nor a stand-in, or the launchers do not read as expected."""
    kernel, inputs, _ = _attention_launch(plan)
    roles = {0: 0, 1: 1, 2: 2}  # query, key, value by position: one tensor may be passed as two of them
    for i, t in enumerate(inputs[3:], 3):
        for role, own in enumerate((plan.out, plan.lse, plan.o_part, plan.lse_part), 3):
            if own is not None and t is own:
                roles[i] = role
        if plan.attn_mask is not None and t is plan.attn_mask:  # (a masked call's mask, by identity)
            roles[i] = ForwardPlan.ROLES.index("attn_mask")
    if plan.descales is not None:  # FP8 descales by position too (the three inputs before o and lse)
        roles.update({len(inputs) - 5 + j: ForwardPlan.ROLES.index(name)
                      for j, name in enumerate(("q_descale", "k_descale", "v_descale"))})
    key_inputs = {1: None, 2: None} if keys else {}
    if blocked_keys(plan):
        roles.update({3: 1, 4: 2})  # the whole blocks' views start where the keys and values do
        if keys:
            key_inputs.update({3: plan.config.block_n, 4: plan.config.block_n})
    attention = _bind(kernel, inputs, roles, key_inputs)
    if attention is None:
        return None
    merge = None
    if plan.split:
        views = _merge_inputs(plan.o_part, plan.lse_part, plan.out, plan.lse, plan.merge.rows, plan.num_splits)
        merge = _bind(_merge_kernel(plan), views, {i: i for i in range(4 if plan.lse is not None else 3)})
        if merge is None:
            return None
    return BoundForward(attention, merge)


def _bind(kernel, inputs, roles: dict, key_inputs=None):
    """The last launch of ``kernel`` on this thread, made with ``inputs``, bound (a
    :class:`BoundGeneratedLaunch`): the inputs with a role (index into the tensors a later call passes)
    put in their slots; the length and strides of ``key_inputs`` (index -> None for keys or values
    themselves, or BLOCK_N for the views of their whole blocks, :func:`_row_blocks`) read per call
    from the tensors of their roles. None where the recorded launch is not one of ``inputs`` or
    holds another call's tensor."""
    key_inputs = key_inputs or {}
    routed = routed_kernel(kernel)
    record = routed.last() if routed is not None else None
    described = launcher_arguments(compat.generated_launcher(kernel)) if record is not None else None
    if described is None or len(described) != len(record[1]):
        return None
    grid, args, num_warps, num_stages = record
    slots, holes = [], []
    for position, (what, *where) in enumerate(described):
        index = where[0] if where else None
        if what in ("size", "stride"):
            # A growing cache's keys keep their batch, heads and head dim (the plan's layout
            # says so): their length and strides are what a later call fills in.
            hole = _key_hole(what == "size", where[1], key_inputs[index]) if index in key_inputs else None
            if hole is not None:
                holes.append((position, roles[index], what == "size", *hole))
        elif what == "input" and isinstance(inputs[index], torch.Tensor):
            role = _tensor_role(args[position], inputs[index], roles.get(index))
            if role is False:
                return None
            if role is not None:
                slots.append((position, role))
    return BoundGeneratedLaunch(routed.launcher, args, slots, holes, grid, num_warps, num_stages, routed.maxnreg)


def _tensor_role(arg, given, role):
    """Where a recorded launch's tensor argument ``arg`` comes from, for ``given``, the input the
    launcher read it from: ``role`` (a later call's tensor of that role), None (a stand-in, the
    same every call), or False where it is another call's tensor or one of this call alone
    (a mask, a seed: those calls are not kept)."""
    if not (isinstance(arg, torch.Tensor) and arg.data_ptr() == given.data_ptr() and arg.shape == given.shape):
        return False  # another call's launch
    if role is not None:
        return role
    return None if _is_stand_in(given) else False


_KEY_LENGTH_DIM = 2  # of the keys and values, (B, H_kv, Lk, D)


def _key_hole(size: bool, dim: int, block_n: int | None):
    """What a growing cache's call fills in for a size (``size``) or stride of dimension ``dim``
    of its keys or values (``block_n`` None) or of the view of their whole blocks (``block_n``,
    (B, H_kv, Lk // BLOCK_N, BLOCK_N, D)): ``(dim, factor)`` of the keys' own, the size divided
    by the factor or the stride multiplied by it; None for what the layout fixes."""
    if block_n is None:
        return (dim, 1) if not size or dim == _KEY_LENGTH_DIM else None
    if size:
        return (_KEY_LENGTH_DIM, block_n) if dim == _KEY_LENGTH_DIM else None
    # the view's strides: (s0, s1, s2 * BLOCK_N, s2, s3) of the keys' (s0, s1, s2, s3)
    return ((0, 1), (1, 1), (2, block_n), (2, 1), (3, 1))[dim]


class BoundGeneratedLaunch(BoundSlots):
    """One NineToothed kernel's launch with the arguments its generated launcher computed for
    one layout (``common.launch.BoundSlots``): a later call puts its tensors in their ``slots``
    ((position, index into the call's tensors)) and, for ``holes`` ((position, index, size or
    stride, dim, factor)), those tensors' sizes and strides."""

    def __init__(self, launcher, args, slots, holes, grid, num_warps, num_stages, maxnreg=None):
        # the holes by tensor, each tensor once: (its index, its holes as (position, size or stride, dim,
        # factor)): a size divided by the factor, a stride multiplied by it (see _key_hole)
        self.hole_tensors = tuple((index, tuple((p, size, dim, f) for p, i, size, dim, f in holes if i == index))
                                  for index in dict.fromkeys(i for _, i, _, _, _ in holes))
        super().__init__(launcher, args, slots, grid, num_warps, num_stages, maxnreg,
                         hole_positions=[p for _, tensor_holes in self.hole_tensors for p, _, _, _ in tensor_holes])

    def __call__(self, tensors) -> None:
        values = []
        for index, holes in self.hole_tensors:  # (one shape and one stride read per tensor)
            shape, stride = tensors[index].shape, tensors[index].stride()
            values += [shape[dim] // factor if size else stride[dim] * factor for _, size, dim, factor in holes]
        super().__call__(tensors, values)


class BoundForward:
    """The forward's launches bound to a layout: the attention kernel's and, for split keys,
    the merge's; called with the tensors ``common.reuse.BoundLaunch`` passes
    (``ForwardPlan.ROLES``: query, key, value, out, lse, o_part, lse_part and FP8 descales)."""

    def __init__(self, attention: BoundGeneratedLaunch, merge: BoundGeneratedLaunch | None):
        self.attention, self.merge = attention, merge

    def __call__(self, tensors) -> None:
        self.attention(tensors)
        if self.merge is not None:
            # The merge's views of the partials and outputs start where they do, and a bound
            # launch reads only a tensor's address: the tensors themselves (lse None: unused).
            self.merge((tensors[5], tensors[6], tensors[3], tensors[4]))

    def launch_keys(self, tensors, blocks_per_split: int) -> None:
        """Launch for keys of another length and strides (bound with ``keys``; the kernel
        derives the blocks per split from the keys' length and the split count, or has them as
        its tile size: then bound per value, ``common.reuse.AttentionPlan``)."""
        self(tensors)

    def launch_plan(self, plan) -> None:
        """Launch a plan of the bound layout whose keys may differ in length and strides."""
        self(plan.tensors())


def backward(plan):
    """Launch the backward for a ``common.plan.BackwardPlan``: the dQ pass (which
    also stores delta), then the dK/dV pass. Returns ``(dq, dk, dv)``, filled in."""
    for kernel, inputs, flags, _ in _backward_launches(plan):
        kernel(*inputs, **flags)
    return plan.grad_query, plan.grad_key, plan.grad_value


def _backward_launches(plan) -> tuple:
    """((kernel, inputs, flags, roles) of the dQ pass, the same of the dK/dV pass): ``kernel(*inputs,
    **flags)`` launches each; ``roles``, for :func:`bind_backward`: which of the plan's tensors
    (index into ``BackwardPlan.ROLES``) each input that is one, or a view of one, is, by position
    (one tensor may be passed as two of them; the whole blocks' views start where their tensors do)."""
    q, k, v = plan.query, plan.key, plan.value
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    config = plan.config
    attn_mask = plan.attn_mask if plan.attn_mask is not None else _absent(q, B, H, Lq, Lk)
    grad_lse = plan.grad_lse if plan.grad_lse is not None else _absent(plan.lse, B, H, Lq)
    flags = dict(BANDED=plan.banded, MASK_KIND=int(plan.mask_kind), DOT_PRECISION=plan.dot_precision,
                 DROPOUT=plan.dropout, SOFTCAP=int(plan.softcap_kind), ALIBI=plan.alibi is not None)
    dropout = _dropout_args(plan)
    blocked = not plan.dropout and plan.alibi is None  # (both passes' unmasked stages, as the forward's: blocked_keys)
    wide = _wide(q, k, v, plan.attn_mask, plan.out, plan.grad_out, plan.lse, plan.grad_lse, plan.grad_query,
                 plan.grad_key, plan.grad_value)
    widths = _width_args(plan, D, Dv)
    dq = (_make(premake_dq, D, Dv, config.block_m2, config.block_n2, *widths,
                num_warps=config.num_warps, num_stages=config.num_stages, wide=wide),
          (q, k, v, _row_blocks(k, config.block_n2, blocked), _row_blocks(v, config.block_n2, blocked), attn_mask,
           plan.out, plan.grad_out, plan.lse, grad_lse, plan.scale, *dropout, *_band_args(plan), *_alibi_args(plan),
           plan.delta, plan.grad_query),
          dict(WITH_DLSE=plan.grad_lse is not None, BLOCKED=blocked, **flags))
    # (query, key, value, out, grad_out, lse[, grad_lse]; delta and dq last)
    dq_roles = {0: 0, 1: 1, 2: 2, 6: 3, 7: 4, 8: 5, len(dq[1]) - 2: 7, len(dq[1]) - 1: 8}
    if plan.grad_lse is not None:
        dq_roles[9] = 6
    if blocked:
        dq_roles.update({3: 1, 4: 2})
    rows = (q, plan.grad_out, plan.lse, plan.delta)
    dkdv = (_make(premake_dkdv, D, Dv, config.block_m1, config.block_n1, *widths,
                  num_warps=config.num_warps, num_stages=config.num_stages, wide=wide),
            (q, k, v, attn_mask, plan.grad_out, plan.lse, plan.delta,
             *(_row_blocks(x, config.block_m1, blocked) for x in rows), plan.scale, *dropout,
             *_band_args(plan, keys=True), *_alibi_args(plan), plan.grad_key, plan.grad_value),
            dict(BLOCKED=blocked, GROUP_OF_ONE=H == k.shape[1], **flags))
    # (query, key, value, grad_out, lse, delta, their whole blocks' views; dk and dv last)
    dkdv_roles = {0: 0, 1: 1, 2: 2, 4: 4, 5: 5, 6: 7, len(dkdv[1]) - 2: 9, len(dkdv[1]) - 1: 10}
    if blocked:
        dkdv_roles.update({7: 0, 8: 4, 9: 5, 10: 7})
    return (*dq, dq_roles), (*dkdv, dkdv_roles)


def bind_backward(plan):
    """The launches of ``plan`` (just launched by :func:`backward`, on this thread) bound to its
    layout, for later calls laid out alike (``common.reuse.KeptBackward``): a
    ``common.launch.BoundSequence`` of the two passes, each made from the arguments
    NineToothed's generated launcher passed (:func:`_bind`), called with the tensors of
    ``BackwardPlan.ROLES``; None where a launch holds a tensor that is neither the plan's own nor a
    stand-in (a mask, dropout's seed, row bands, ALiBi's slopes)."""
    bound = []
    for kernel, inputs, _, roles in _backward_launches(plan):
        launch = _bind(kernel, inputs, roles)
        if launch is None:
            return None
        bound.append(launch)
    return BoundSequence(*bound)


# A step's tiles of small pages one softmax update, their scores joined (paged_tiles), or each tile its own.
# Joined (the default): one row maximum and rescale a step instead of one a tile, faster at pages of 16
# (benchmarks/NOTES.md); False keeps the per-tile form, which the paged tests run beside it.
PAGED_JOIN = True
# FP8 caches' joined steps of 16-key tiles with their key tiles joined into one block before one score product, and
# their value tiles before one value product (paged_application's JOIN_TILES), instead of a product a tile: a
# 16-key product gives each warp the whole tile, and its FP8 elements to widen, where a joined one splits the keys
# over the warps (fewer products, conversions and registers a step compiled for sm_90; tiles of 32 keys and 16-bit
# caches gain nothing: benchmarks/NOTES.md). Off until timed.
PAGED_FP8_JOIN_TILES = False
# Tiles unrolled a step, at most (a step of more keys takes this many): each is a gather of its own, and
# triton's async-copy coalescing pass after 3.6 takes time that grows much faster than their count
# (benchmarks/NOTES.md has the timings). So triton 3.6 keeps the 8 the configs were tuned with, and later
# versions take 4, so that a first call compiles in seconds.
PAGED_TILES_PER_STEP = 8 if compat.triton_version() <= (3, 6) else 4
# FP8 caches at most 4 on any version: their tiles widened to float16 take twice the registers, and 8 of them
# spill on sm_90 (benchmarks/NOTES.md has the timings).
PAGED_FP8_TILES_PER_STEP = 4
# Warps of the FP8 kernel for tiles of 16 keys with column-major value pages (the plan's otherwise): over 4
# warps each warp holds 4 keys of the scores' 8-key fragments and converts its FP8 elements twice; 2 warps
# halve that (benchmarks/NOTES.md has the timings; row-major pages and larger tiles gain nothing). Such a
# launch takes no register cap: 2 warps already fit 5 programs an SM, and capped at 128 they ran 1.5x slower.
# None: the plan's warps and cap.
PAGED_FP8_SMALL_TILE_WARPS = 2


def paged_tiles(page: int, block_n: int, fp8: bool = False) -> tuple[int, int, int]:
    """(tile, tiles per step, tiles joined a softmax update) of the paged kernel for pages of
    ``page`` keys (a multiple of 16) and steps of ``block_n``: the largest power of two that
    divides the page, at most a step; a step of BLOCK_N keys (one tile where pages are larger than
    a step), at most PAGED_TILES_PER_STEP tiles (``fp8`` caches: at most PAGED_FP8_TILES_PER_STEP
    too); with PAGED_JOIN, the step's tiles one softmax update, else each its own."""
    tile = min(page & -page, block_n)
    cap = min(PAGED_TILES_PER_STEP, PAGED_FP8_TILES_PER_STEP) if fp8 else PAGED_TILES_PER_STEP
    per_step = min(max(1, block_n // tile), cap)
    return tile, per_step, per_step if PAGED_JOIN else 1


def paged_forward(plan):
    """Launch paged attention (and, for split keys, the merge) for a ``common.paged.PagedPlan``.
    Returns ``(plan.out, plan.lse)``, filled in (``plan.lse`` None unless ``plan.with_lse``)."""
    q, out = plan.query, plan.out
    B, H, Lq, D = q.shape
    kc, vc = plan.key_cache, plan.value_cache
    Dv = vc.shape[3]
    config = plan.config
    if plan.split:
        o, lse = plan.o_part, plan.lse_part
    else:
        o, lse = out, plan.lse if plan.with_lse else _absent(out, B, H, Lq)
    fp8 = kc.element_size() == 1
    tile, tiles_per_step, join = paged_tiles(kc.shape[1], config.block_n, fp8)
    # (the table's tile per split: its pages)
    pages_per_split = plan.blocks_per_split * plan.split_block // kc.shape[1] if plan.split else None
    # column-major value pages: the kernel's variant that takes them with their keys last
    # (paged_application's VALUE_COLUMNS)
    value_columns = column_pages(vc)
    num_warps, maxnreg = config.num_warps, config.maxnreg
    if PAGED_FP8_SMALL_TILE_WARPS and fp8 and value_columns and tile == 16:
        num_warps, maxnreg = PAGED_FP8_SMALL_TILE_WARPS, None
    # (each page's keys viewed as tiles of `tile`: premake_paged's caches)
    tiles = (kc.shape[1] // tile, tile)
    values = vc.permute(0, 2, 3, 1).unflatten(3, tiles) if value_columns else vc.unflatten(1, tiles)
    _make(premake_paged, D, Dv, config.block_m, tile, pages_per_split, value_columns, *_width_args(plan, D, Dv),
          num_warps=num_warps, num_stages=config.num_stages, maxnreg=maxnreg,
          wide=_wide(q, kc, vc, plan.block_table, o))(
        q, kc.unflatten(1, tiles), values, plan.block_table, plan.cache_seqlens,
        plan.leftpad if plan.leftpad is not None else _absent(plan.cache_seqlens, B),
        plan.query_lengths if plan.query_lengths is not None else _absent(plan.cache_seqlens, B), plan.scale,
        plan.lq_seq,
        kc.shape[0],
        *(plan.band if plan.band is not None else (0, 0)), plan.softcap,
        plan.sinks if plan.sinks is not None else _absent(out, B, H, Lq),
        plan.alibi if plan.alibi is not None else _absent(out, B, H, Lq),
        *(plan.descales if plan.descales is not None else (_absent(out, B, kc.shape[2]),) * 2), o, lse,
        BANDED=plan.band is not None, WITH_LSE=plan.split or plan.with_lse, DOT_PRECISION=plan.dot_precision,
        SPLIT=plan.split, TILES_PER_STEP=tiles_per_step, JOIN=join,
        JOIN_TILES=PAGED_FP8_JOIN_TILES and fp8 and tile == 16 and join > 1, SOFTCAP=int(plan.softcap_kind),
        SINKS=plan.sinks is not None, ALIBI=plan.alibi is not None, LEFTPADDED=plan.leftpad is not None,
        QUERY_LENGTHS=plan.query_lengths is not None, DESCALE=plan.descales is not None,
        WIDEN=int(cache_widen(plan.descales, vc)), VALUE_COLUMNS=value_columns,
    )
    if plan.split:
        merge = plan.merge
        _make(premake_combine, Dv, merge.block_r, merge.block_s, num_warps=4, num_stages=1,
              wide=_wide(plan.o_part, out))(
            *_merge_inputs(plan.o_part, plan.lse_part, out, plan.lse, merge.rows, plan.num_splits),
            WITH_LSE=plan.with_lse,
        )
    return out, plan.lse


def append_kv(key_cache, value_cache, block_table, cache_seqlens, key, value, *, block_m: int, block_d: int,
              block_dv: int, descales=None):
    """Write key and value (B, H_kv, L_new, D | Dv) into the paged caches, in one launch
    (one program per token: see append_arrangement; block sizes as the Triton kernel's API;
    ``descales``: FP8 caches' (B, H_kv) key and value descales, the new tokens quantized)."""
    D, Dv = key.shape[3], value.shape[3]
    stand_ins = descales if descales is not None else (_absent(key, *key.shape[:2]),) * 2
    _make(premake_append, D, Dv, num_warps=4, num_stages=1, wide=_wide(key, value, key_cache, value_cache))(
        key, value, key_cache, value_cache, block_table, cache_seqlens, key_cache.shape[0], *stand_ins,
        QUANTIZE=descales is not None)


def rotary(x1, x2, o1, o2, cos, sin, starts, per_row: bool) -> None:
    """Rotate the pairs (x1, x2) (B, L, H, R/2 strided views) by the angles of rows
    ``starts[b]`` (+ l where ``per_row``) of cos and sin (S, R/2), into (o1, o2): one program
    per (batch, row, head), see rotary_arrangement."""
    _make(premake_rotary, x1.shape[3], num_warps=4, num_stages=1, wide=_wide(x1, x2, o1, o2))(
        x1, x2, o1, o2, cos, sin, starts, PER_ROW=per_row)


def copy_values(value, out, pv_order: bool = False) -> None:
    """Copy ``value`` (B, H, L, D) into ``out``, the same shape in another layout (the FP8 values
    column-major for the e4m3 P·V product: ``common.plan.Planner.fp8_columns``; ``pv_order``: each
    group of 32 keys in the P·V order, ``common.plan.pv_position``): one program per 64 rows of a
    (batch, head), see copy_arrangement."""
    _make(premake_copy, value.shape[3], 64, num_warps=4, num_stages=1, wide=_wide(value, out))(
        value, out, PV_ORDER=pv_order)
